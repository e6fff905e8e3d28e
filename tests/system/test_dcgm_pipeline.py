"""Real GPU utilisation end to end: a fixture dcgm-exporter scraped by a real Prometheus, read by the DCGM source
of the simulated executor, through the whole stack on the real bus.

The fixture serves whole GPUs (with pod labels, renamed exported_* by Prometheus' relabelling), MIG instances and
GPUs without pod labels. With jobs placed on those GPUs, the test asserts that the samples reach the metering
ledger with the used GPU-hours the fixture's values imply, that the idle-GPU alert fires in the started Prometheus
(the real rule, evaluated by Prometheus, its durations shortened), that MFU shows, and that an XID error makes the
node degraded so that the scheduler avoids it until the fault clears.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import pytest

from services.api.readmodel import fetch_status
from services.executor.sim import DURATION_LABEL, sim_pod_name
from services.stack import Stack, StackSettings
from shared.config import DcgmSettings, parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet, Precision
from shared.events import JobFlopsReported, JobSubmitted, NodeChanged, make_event
from shared.mfu import flops_event
from shared.service import publish_event
from tests.support.dcgm_fixture import FixtureExporter, FixtureGpu
from tests.support.prometheus_process import free_port, query, running_prometheus

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules" / "gpuq.rules.yml"
INTERVAL_S = 2.0
PIPELINE = ("admission", "scheduler", "executor", "metering", "telemetry")  # no API server: no fixed port

CLUSTER = parse_cluster({"node_groups": [
    # One node per shape, so that every job's node (and so its fixture series) is known in advance.
    {"name": "h100", "count": 1, "gpus_per_node": 4, "gpu_model": "H100-80GB", "cpu_milli": 64000,
     "memory_mib": 524288},
    {"name": "h100s", "count": 1, "gpus_per_node": 2, "gpu_model": "H100-80GB", "cpu_milli": 64000,
     "memory_mib": 524288},
    {"name": "l40s", "count": 1, "gpus_per_node": 2, "gpu_model": "L40S", "cpu_milli": 64000, "memory_mib": 524288},
    {"name": "mig", "count": 1, "gpus_per_node": 1, "gpu_model": "A100-80GB", "cpu_milli": 64000,
     "memory_mib": 524288, "mig": {"profile": "1g.10gb", "slices_per_gpu": 7}},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [
        {"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 6},
                                                           "A100-80GB:1g.10gb": {"nominal": 7}}},
        {"name": "team-b", "teams": ["team-b"], "quotas": {"L40S": {"nominal": 2}}},
    ],
    "gpu_flavors": {"H100-80GB": {"cost_per_gpu_hour": 4.0, "peak_tflops": {"bf16": 989.0}}},
})

# What the fixture reports: the training job's GPUs busy, the idle job's GPUs idle, the notebook's slices half busy.
TRAIN_UTIL, IDLE_UTIL, MIG_UTIL = 0.75, 0.02, 0.5
MIG_SHARE = 142  # milli-GPUs of a 1g.10gb slice


def spec(job_id: str, team: str, pod_set: PodSet) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(pod_set,), max_runtime_s=7200,
                   labels={DURATION_LABEL: "3600"})


TRAIN = spec("train", "team-a", PodSet(name="main", count=1, gpus_per_pod=4, gpu_models=("H100-80GB",)))
IDLE = spec("idle", "team-b", PodSet(name="main", count=1, gpus_per_pod=2, gpu_models=("L40S",)))
NOTEBOOK = spec("notebook", "team-a", PodSet(name="nb", count=2, gpu_models=("A100-80GB",), mig_profile="1g.10gb"))
LATE = spec("late", "team-a", PodSet(name="main", count=1, gpus_per_pod=2, gpu_models=("H100-80GB",)))


def fixture_gpus() -> list[FixtureGpu]:
    def values(util: float, fb: float, tensor: float | None = None) -> dict[str, float]:
        out = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": util, "DCGM_FI_DEV_GPU_UTIL": round(util * 100),
               "DCGM_FI_DEV_FB_USED": fb, "DCGM_FI_DEV_FB_FREE": 81_000 - fb,
               "DCGM_FI_DEV_POWER_USAGE": 90 + 500 * util, "DCGM_FI_DEV_GPU_TEMP": 45 + 30 * util,
               "DCGM_FI_DEV_XID_ERRORS": 0}
        if tensor is not None:
            out["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] = tensor
        return out

    gpus = [
        # Whole GPUs with pod mapping on: the training job's pod is named on its GPUs.
        *(FixtureGpu("h100-0", g, "NVIDIA H100 80GB HBM3", values(TRAIN_UTIL, 60_000, tensor=0.45),
                     pod=("team-a", sim_pod_name("train", "main-0"), "trainer")) for g in range(4)),
        # A free node (no pod on it): the XID will land here.
        *(FixtureGpu("h100s-0", g, "NVIDIA H100 80GB HBM3", values(0.0, 0)) for g in range(2)),
        # No pod labels at all: attributed by (Hostname, gpu) from the executor's placement.
        *(FixtureGpu("l40s-0", g, "NVIDIA L40S", values(IDLE_UTIL, 3_000, tensor=0.0)) for g in range(2)),
        # A MIG GPU: the whole-GPU series plus one per GPU instance, no pod labels.
        FixtureGpu("mig-0", 0, "NVIDIA A100-SXM4-80GB", values(MIG_UTIL * 2 / 7, 18_000)),
    ]
    for instance in range(7):
        v = values(MIG_UTIL if instance < 2 else 0.0, 9_000 if instance < 2 else 0)
        v = {k: x for k, x in v.items() if k not in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE")}
        gpus.append(FixtureGpu("mig-0", 0, "NVIDIA A100-SXM4-80GB", v, instance=instance, profile="1g.10gb"))
    return gpus


def shortened_rules(tmp: Path) -> Path:
    """The real rule file with its waiting times shortened to seconds (Prometheus runs on wall time)."""
    text = RULES.read_text()
    for old, new in (("[5m]) < 0.05)", "[4s]) < 0.05)"), ("for: 30m", "for: 4s"), ("for: 5m", "for: 2s")):
        assert old in text, f"the rule file changed: {old!r} not found; update this test"
        text = text.replace(old, new)
    path = tmp / "gpuq.rules.yml"
    path.write_text(text)
    return path


async def wait_for(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.5)


async def prom(url: str, expr: str) -> list[dict[str, Any]]:
    data = await asyncio.to_thread(query, url, expr)
    result: list[dict[str, Any]] = data["result"]
    return result


async def test_dcgm_samples_reach_the_ledger_the_idle_alert_fires_and_an_xid_degrades_the_node(
        fresh: tuple[str, str], tmp_path: Path) -> None:
    nats_url, database_url = fresh
    exporter = FixtureExporter(fixture_gpus())
    exporter_port = exporter.start()
    metrics_port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(shortened_rules(tmp_path))],
        "scrape_configs": [
            # The exporter runs as a pod itself: its target labels pod/namespace clash with the series' own, which
            # Prometheus therefore renames exported_pod/exported_namespace (honor_labels: false, the default).
            {"job_name": "dcgm-exporter", "static_configs": [{
                "targets": [f"127.0.0.1:{exporter_port}"],
                "labels": {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-7x2kq"}}]},
            {"job_name": "gpuq", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
        ],
    }
    try:
        with running_prometheus(tmp_path, config) as prom_url:
            dcgm = DcgmSettings(prometheus_url=prom_url, interval_s=INTERVAL_S, lookback_s=2 * INTERVAL_S,
                                timeout_s=INTERVAL_S, selector='job="dcgm-exporter"', missing_gpu_polls=2,
                                recovery_polls=2)
            # The per-job MFU gauges (job-id labels) are exported only when asked for.
            settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                                     services=PIPELINE, metrics_port=metrics_port, dcgm=dcgm, metrics_job_labels=True)
            async with Stack(settings):
                await scenario(nats_url, database_url, prom_url, exporter)
    finally:
        exporter.stop()


async def scenario(nats_url: str, database_url: str, prom_url: str, exporter: FixtureExporter) -> None:
    nc = await nats.connect(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        js = nc.jetstream()
        for s in (TRAIN, IDLE, NOTEBOOK):
            now = datetime.now(UTC)
            await publish_event(js, make_event(JobSubmitted(spec=s, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(s.team))

        async def running() -> bool:
            rows = {r["job_id"]: r["state"] for r in await fetch_status(database_url, None)}
            return all(rows.get(j) == "running" for j in ("train", "idle", "notebook"))

        await wait_for("the three jobs to run", running)
        placed = {r["job_id"]: r["nodes"] for r in await fetch_status(database_url, None)}
        assert placed == {"train": ["h100-0"], "idle": ["l40s-0"], "notebook": ["mig-0"]}

        # ---- 1. the ledger: every sample of every job carries the fixture's value, used GPU-time follows
        async def enough_samples() -> bool:
            rows = await conn.fetch("SELECT job_id, count(*) AS n FROM metering.gpu_samples "
                                    "WHERE job_id IS NOT NULL GROUP BY job_id")
            counts: dict[str, int] = {r["job_id"]: r["n"] for r in rows}
            return counts.get("train", 0) >= 4 * 3 and counts.get("idle", 0) >= 2 * 3 and counts.get("notebook", 0) >= 6

        await wait_for("samples of every job in the ledger", enough_samples)
        samples = await conn.fetch("SELECT * FROM metering.gpu_samples WHERE job_id IS NOT NULL ORDER BY sampled_at")
        expect = {"train": (TRAIN_UTIL, 1000, {0, 1, 2, 3}, {-1}), "idle": (IDLE_UTIL, 1000, {0, 1}, {-1}),
                  "notebook": (MIG_UTIL, MIG_SHARE, {0}, {0, 1})}
        for job, (util, milli, gpus, instances) in expect.items():
            rows = [r for r in samples if r["job_id"] == job]
            assert {r["gpu_index"] for r in rows} == gpus and {r["gpu_instance"] for r in rows} == instances
            assert not any(r["approximate"] for r in rows)
            assert {r["interval_ms"] for r in rows} == {2000}
            assert all(r["utilization_pct"] == pytest.approx(util * 100, abs=1e-4) for r in rows), job
            assert all(r["milli_gpus"] == milli for r in rows)
            per_sample = round(util * 100 * 2000 * milli / 100_000)
            assert {r["used_gpu_ms"] for r in rows} == {per_sample}, job
            # The hourly rollup the reports read holds exactly the samples' used GPU time.
            used, sampled, n = await conn.fetchrow(
                "SELECT sum(used_gpu_ms), sum(sampled_gpu_ms), sum(samples) FROM metering.usage_hourly "
                "WHERE job_id = $1", job)
            assert n >= len(rows) and used == n * per_sample and sampled == n * 2000 * milli // 1000, job
        # Energy: the MIG instances get their slice of the parent GPU's power.
        mig_power = [r["power_w"] for r in samples if r["job_id"] == "notebook"]
        assert mig_power == pytest.approx([(90 + 500 * MIG_UTIL * 2 / 7) * MIG_SHARE / 1000] * len(mig_power),
                                          rel=1e-3)
        # Free GPUs are sampled too, with no job (capacity and idle figures need them).
        free = await conn.fetchval("SELECT count(*) FROM metering.gpu_samples "
                                   "WHERE job_id IS NULL AND node = 'h100s-0'")
        assert free > 0

        # ---- 2. MFU: the training job reports its throughput; the idle job shows only the proxy
        started = await conn.fetchval("SELECT started_at FROM executor.runs WHERE job_id = 'train'")
        assert started is not None
        # Another team cannot report for the training job: only a report on team-a's subject is believed.
        forged = flops_event("train", 4 * 989e12 * 0.9, Precision.BF16, at=datetime.now(UTC), source="test/forged")
        await publish_event(js, forged, JobFlopsReported.scoped_subject("team-b"))
        report = flops_event("train", 4 * 989e12 * 0.4, Precision.BF16, at=datetime.now(UTC), source="test/train")
        await publish_event(js, report, JobFlopsReported.scoped_subject("team-a"))

        # ---- 3. the idle-GPU alert, evaluated by the started Prometheus on the pipeline's own metrics
        async def idle_alert() -> list[dict[str, Any]]:
            return await prom(prom_url, 'ALERTS{alertname="GpuqAllocatedGpuIdle", alertstate="firing"}')

        alerts = await wait_for("GpuqAllocatedGpuIdle to fire", idle_alert)
        assert sorted((a["metric"]["node"], a["metric"]["gpu"], a["metric"]["queue"]) for a in alerts) == [
            ("l40s-0", "0", "team-b"), ("l40s-0", "1", "team-b")]

        async def mfu() -> list[dict[str, Any]]:
            return await prom(prom_url, 'gpuq_job_mfu_ratio{job_id="train"}')

        mfu_series = await wait_for("the training job's MFU", mfu)
        assert float(mfu_series[0]["value"][1]) == pytest.approx(0.4) and mfu_series[0]["metric"]["precision"] == "bf16"
        refused = await prom(prom_url, 'gpuq_flops_reports_rejected_total{reason="WrongTeam"}')
        assert float(refused[0]["value"][1]) == 1
        proxy = await prom(prom_url, 'gpuq_job_tensor_active_ratio{job_id="train"}')
        assert float(proxy[0]["value"][1]) == pytest.approx(0.45)
        source = await prom(prom_url, 'gpuq_utilization_source_gpus{attribution="exact"}')
        assert float(source[0]["value"][1]) == 4 + 2 + 2  # train, idle, notebook's two slices
        await dashboard_panels_have_data(prom_url)

        # ---- 4. an XID error degrades the node; the scheduler avoids it until the fault clears
        exporter.set("h100s-0", 1, "DCGM_FI_DEV_XID_ERRORS", 79)

        async def degraded() -> bool:
            row = await conn.fetchval("SELECT spec FROM scheduler.nodes WHERE name = 'h100s-0'")
            return row is not None and json.loads(row)["health"] == "degraded"

        await wait_for("h100s-0 to be degraded", degraded)
        changed = await conn.fetchval("SELECT body FROM executor.outbox WHERE subject = $1 ORDER BY seq DESC LIMIT 1",
                                      NodeChanged.subject())
        assert json.loads(changed)["data"]["reason"] == "Xid79"
        now = datetime.now(UTC)
        await publish_event(js, make_event(JobSubmitted(spec=LATE, submitted_at=now), source="test", time=now),
                            JobSubmitted.scoped_subject(LATE.team))

        async def late_waits_for_placement() -> str | None:
            rows = await fetch_status(database_url, "late")
            ok = rows and rows[0]["state"] == "admitted" and rows[0]["sched_reason"]
            return rows[0]["sched_reason"] if ok else None

        reason = await wait_for("the late job to wait for GPUs", late_waits_for_placement)
        assert reason == "InsufficientGpus"  # the only free H100s are on the degraded node
        await asyncio.sleep(3 * INTERVAL_S)
        assert (await fetch_status(database_url, "late"))[0]["state"] == "admitted"  # still not placed

        async def degraded_alert() -> list[dict[str, Any]]:
            return await prom(prom_url, 'ALERTS{alertname="GpuqNodeDegraded", alertstate="firing"}')

        fired = await wait_for("GpuqNodeDegraded to fire", degraded_alert)
        assert [(a["metric"]["node"], a["metric"]["reason"]) for a in fired] == [("h100s-0", "Xid79")]

        exporter.set("h100s-0", 1, "DCGM_FI_DEV_XID_ERRORS", 0)  # the GPU was reset

        async def late_runs_on_the_recovered_node() -> list[str] | None:
            row = (await fetch_status(database_url, "late"))[0]
            return row["nodes"] if row["state"] == "running" else None

        assert await wait_for("the late job to run after recovery", late_runs_on_the_recovered_node) == ["h100s-0"]
    finally:
        await conn.close()
        await nc.close()


async def dashboard_panels_have_data(prom_url: str) -> None:
    """The new panels (MFU / proxy for users; MFU, proxy and attribution for the platform) return data."""
    titles = {"gpuq-ml-engineers": {"Model FLOPs utilisation of my running jobs (tensor-core activity as a proxy)"},
              "gpuq-platform": {"MFU by queue, and tensor-core activity by pool (proxy)",
                                "GPU samples by attribution (DCGM source)"}}
    for uid, wanted in titles.items():
        doc = json.loads((REPO / "deploy" / "grafana" / "dashboards" / f"{uid}.json").read_text())
        panels = {p["title"]: p for p in doc["panels"] if p["title"] in wanted}
        assert set(panels) == wanted
        for title, panel in panels.items():
            for target in panel["targets"]:
                expr = re.sub(r"\$(team|queue|pool|gpu_model)\b", ".*", target["expr"])
                result = await prom(prom_url, expr)
                if target["refId"] == "A" or "proxy" not in target["legendFormat"]:
                    assert result, f"{uid}: {title}: {target['legendFormat']} has no data"


async def test_an_unreachable_prometheus_is_reported_and_scheduling_goes_on(
        fresh: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    nats_url, database_url = fresh
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    metrics_port = free_port()
    quick = JobSpec(job_id="quick", team="team-b", queue="team-b", max_runtime_s=60, labels={DURATION_LABEL: "2"},
                    pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("L40S",)),))
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=PIPELINE, metrics_port=metrics_port,
                             dcgm=DcgmSettings(prometheus_url=dead, interval_s=1, timeout_s=1))
    caplog.set_level("ERROR", logger="gpuq.executor.dcgm")
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        now = datetime.now(UTC)
        await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=quick, submitted_at=now), source="test",
                                                       time=now), JobSubmitted.scoped_subject(quick.team))

        async def completed() -> bool:
            rows = await fetch_status(database_url, "quick")
            return bool(rows) and rows[0]["state"] == "completed"

        await wait_for("the job to complete without Prometheus", completed)
        await nc.close()

        async def metrics() -> str | None:
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            return text if 'gpuq_utilization_source_failures_total{reason="Unreachable",source="dcgm"}' in text \
                else None

        text = await wait_for("the source's failure metrics", metrics)
        assert 'gpuq_utilization_source_up{source="dcgm"} 0.0' in text
    errors = [r.getMessage() for r in caplog.records if r.name == "gpuq.executor.dcgm"]
    assert errors and f"cannot reach Prometheus at {dead}" in errors[0]
    assert "scheduling continues" in errors[0]
    assert len(errors) <= 2  # once per outage, not once per poll
