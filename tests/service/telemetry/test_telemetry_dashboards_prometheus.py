"""Every Grafana panel's query runs on a real Prometheus that scrapes a live telemetry /metrics endpoint
fed with a short synthetic event stream; no query may error and the key panels must return data."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from services.telemetry.app import TelemetryService
from shared.config import parse_queues
from shared.domain import NodeHealth, NodeUsage
from shared.events import (
    ExitReason,
    GpuSample,
    JobAdmitted,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    Payload,
    PreemptionReason,
    UtilizationSampled,
)
from tests.support.prometheus_process import query, running_prometheus
from tests.unit.telemetry.telemetry_builders import bindings, node, spec

REPO = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
RULES = REPO / "deploy" / "prometheus" / "rules" / "gpuq.rules.yml"
KEY_PANELS = {
    "gpuq-ml-engineers": {"Why my jobs wait", "Expected start (ETA)", "Position in queue", "Waiting so far",
                          "Pending jobs by reason", "GPU utilisation of my running jobs", "GPUs held by my jobs",
                          "How my jobs ended (time range)", "Oldest checkpoint among running jobs"},
    "gpuq-platform": {"Pending jobs by queue", "Running jobs by queue", "GPU allocation by pool",
                      "Free and fragmented GPUs", "Allocated vs used GPUs", "Idle allocated GPUs (< 5% now)",
                      "Nodes by health", "Guaranteed quota vs ready capacity", "Admission wait p95 by queue",
                      "Preemptions by queue and reason", "GPU memory used by pool", "GPUs held outside gpuq"},
    "gpuq-managers": {"GPU-hours by team", "Cost by team", "GPU-hours by feature", "Cost by feature",
                      "Idle allocated GPU-hours by team", "GPU efficiency by team", "GPU-hours lost to preemption"},
}
# Telemetry drops a node's samples after 3 intervals. Long enough that the last round's samples are still current
# when the panels are queried, however slowly a loaded machine gets there (with 2 s they went stale after 6 s).
SAMPLE_INTERVAL_S = 60.0
SUBSTITUTIONS = {"$__rate_interval": "15s", "$__range": "5m", "$__interval": "1s"}
VARIABLE_RE = re.compile(r"\$(team|queue|pool|gpu_model|feature)\b")


# Telemetry drops a node's samples after 3 intervals (STALE_SAMPLE_INTERVALS). The queries below run a while after
# the last samples on a loaded machine; an interval this long keeps them current for the whole test.
SAMPLE_INTERVAL_S = 60.0


def dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def stream_phase1(now: float) -> list[Payload]:
    # h1: an inference pod gpuq does not manage holds 4 of its GPUs (what the executor announces on Kubernetes)
    held = node("h1").model_copy(update={"held": NodeUsage(gpus=4, pods=1)})
    nodes = (node("h0"), held, node("h2", health=NodeHealth.FAILED), node("i0", model="L4", pool="inference"))
    running = spec("train-1", team="team-a", gpus_per_pod=4, feature="llm")
    idle = spec("stuck-1", team="team-b", gpus_per_pod=2, feature="vision")
    waiting = spec("big-1", team="team-a", pods=2, gpus_per_pod=8, models=("H100",), feature="llm")
    out: list[Payload] = [NodeInventory(nodes=nodes)]
    for s, place, wait in ((running, {"h0": [0, 1, 2, 3]}, 40), (idle, {"h1": [0, 1]}, 5)):
        out += [JobSubmitted(spec=s, submitted_at=dt(now - 600)),
                JobAdmitted(job_id=s.job_id, spec=s, admitted_at=dt(now - 600 + wait)),
                JobPlaced(job_id=s.job_id, spec=s, bindings=bindings(s, place), placed_at=dt(now - 500)),
                JobStarted(job_id=s.job_id, started_at=dt(now - 500))]
    out += [JobSubmitted(spec=waiting, submitted_at=dt(now - 300)),
            JobPending(job_id="big-1", queue="team-a", reason="QuotaExhausted", message="needs 16 GPUs",
                       position_in_queue=1, eta=dt(now + 1800))]
    return out + samples(now)


def samples(now: float) -> list[Payload]:
    return [UtilizationSampled(node="h0", gpu_model="H100", sampled_at=dt(now), interval_s=SAMPLE_INTERVAL_S,
                               samples=tuple(GpuSample(job_id="train-1", gpu_index=g, utilization_pct=85,
                                                       memory_used_mib=60_000) for g in range(4))),
            UtilizationSampled(node="h1", gpu_model="H100", sampled_at=dt(now), interval_s=SAMPLE_INTERVAL_S,
                               samples=tuple(GpuSample(job_id="stuck-1", gpu_index=g, utilization_pct=1,
                                                       memory_used_mib=2_000) for g in range(2)))]


def stream_phase2(now: float, i: int) -> list[Payload]:
    """A few more lifecycles per round, so counters and histograms move between scrapes."""
    s = spec(f"short-{i}", team="team-b" if i % 2 else "team-a", feature="eval")
    end: Payload = JobCompleted(job_id=s.job_id, finished_at=dt(now))
    if i % 3 == 0:
        end = JobFailed(job_id=s.job_id, exit_reason=ExitReason.OOM_KILLED, finished_at=dt(now))
    out = [JobSubmitted(spec=s, submitted_at=dt(now - 120)),
           JobAdmitted(job_id=s.job_id, spec=s, admitted_at=dt(now - 100 + i)),
           JobPlaced(job_id=s.job_id, spec=s, bindings=bindings(s, {"i0": [i % 8]}), placed_at=dt(now - 90)),
           JobStarted(job_id=s.job_id, started_at=dt(now - 90)),
           UtilizationSampled(node="i0", gpu_model="L4", sampled_at=dt(now), interval_s=SAMPLE_INTERVAL_S,
                              samples=(GpuSample(job_id=s.job_id, gpu_index=i % 8, utilization_pct=40),)),
           end]
    if i == 1:
        out += [JobPreempted(job_id="train-1", reason=PreemptionReason.PRIORITY, preemptor="big-1",
                             lost_gpu_seconds=900.0, preempted_at=dt(now)),
                JobAdmitted(job_id="train-1", spec=spec("train-1", team="team-a", gpus_per_pod=4, feature="llm"),
                            admitted_at=dt(now + 1)),
                JobPlaced(job_id="train-1", spec=spec("train-1", team="team-a", gpus_per_pod=4, feature="llm"),
                          bindings=bindings(spec("train-1", gpus_per_pod=4), {"h0": [0, 1, 2, 3]}),
                          placed_at=dt(now + 1)),
                JobStarted(job_id="train-1", started_at=dt(now + 1))]
    return out + samples(now)


@pytest.fixture
def telemetry() -> Iterator[tuple[TelemetryService, int]]:
    svc = TelemetryService(metrics_port=None, webhook_worker=False, job_labels=True)  # the per-job panels need them
    svc.state.set_queues(parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "team-a", "quotas": {"H100": {"nominal": 16}}},
                   {"name": "team-b", "quotas": {"H100": {"nominal": 16}, "L4": {"nominal": 8}}}],
        "gpu_flavors": {"H100": {"cost_per_gpu_hour": 3.0}, "L4": {"cost_per_gpu_hour": 0.5}}}))
    port = svc.metrics.serve(0, "127.0.0.1")
    try:
        yield svc, port
    finally:
        svc.metrics.shutdown()


@pytest.fixture
def prometheus(tmp_path: Path, telemetry: tuple[TelemetryService, int]) -> Iterator[str]:
    _, metrics_port = telemetry
    with running_prometheus(tmp_path, {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gpuq", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }) as url:
        yield url


def wait_for_scrapes(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = query(url, 'count_over_time(up{job="gpuq"}[5m])')["result"]
        if result and float(result[0]["value"][1]) >= n:
            up = query(url, 'up{job="gpuq"}')["result"]
            assert up and up[0]["value"][1] == "1", "the telemetry endpoint is down"
            return
        time.sleep(0.3)
    raise AssertionError(f"fewer than {n} scrapes in 60 s")


def expand(expr: str) -> str:
    for k, v in SUBSTITUTIONS.items():
        expr = expr.replace(k, v)
    return VARIABLE_RE.sub(".*", expr)


def test_every_panel_query_runs_and_key_panels_have_data(
        telemetry: tuple[TelemetryService, int], prometheus: str) -> None:
    svc, _ = telemetry
    for p in stream_phase1(time.time()):
        svc.apply(p, time.time())
    wait_for_scrapes(prometheus, 2)
    for i in range(1, 4):
        for p in stream_phase2(time.time(), i):
            svc.apply(p, time.time())
        wait_for_scrapes(prometheus, 2 + 2 * i)

    empty: list[str] = []
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for var in doc["templating"]["list"]:
            if var["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"]).groups()
                values = httpx.get(f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric},
                                   timeout=10).json()["data"]
                assert values, f"{doc['uid']}: variable {var['name']} has no values"
        panels = [p for p in doc["panels"] if p["type"] != "row"]
        for panel in panels:
            results = [query(prometheus, expand(t["expr"]))["result"] for t in panel["targets"]]
            if panel["title"] in KEY_PANELS[doc["uid"]] and not all(results):
                empty.append(f"{doc['uid']}: {panel['title']}")
        missing = KEY_PANELS[doc["uid"]] - {p["title"] for p in panels}
        assert not missing, f"{doc['uid']}: key panels not found: {missing}"
    assert not empty, f"key panels without data: {empty}"

    # The idle GPU is recognised per queue/team, and guarantees vs capacity are both there.
    idle = query(prometheus, "count by (queue, team) ((gpuq_node_gpu_utilization_ratio < 0.05) "
                             "* on (node, gpu) group_left (queue, team) gpuq_node_gpu_allocated)")["result"]
    assert [(r["metric"]["queue"], r["value"][1]) for r in idle] == [("team-b", "2")]
