"""The OpenTelemetry → Prometheus exposition: names, units, labels, and gauges that follow the core."""

from __future__ import annotations

import functools
import re

import httpx
import pytest

from services.core.telemetry.names import COUNTER, METRICS
from services.core.telemetry.state import TelemetryState
from services.telemetry.metrics import JOB_LABELS_ENV, TelemetryMetrics, job_labels_from_env
from shared.events import ExitReason, JobCancelled
from tests.unit.telemetry.telemetry_builders import T0, inventory, life, node, spec

NAME_RE = re.compile(r"^gpuq_[a-z0-9_]+$")


def test_metric_definitions_follow_prometheus_conventions() -> None:
    for name, d in METRICS.items():
        assert NAME_RE.match(name), name
        assert not name.endswith("_total"), f"{name}: the exporter adds _total to counters"
        if d.unit == "s":
            assert name.endswith("_seconds"), name
        if d.unit == "By":
            assert name.endswith("_bytes"), name
        if d.kind != COUNTER and not name.startswith("gpuq_job_"):
            assert "job_id" not in d.labels, name


def feed(state: TelemetryState, metrics: TelemetryMetrics, events: list) -> None:
    for t, p in sorted(events, key=lambda e: e[0]):
        metrics.record(state.apply(p, T0 + t).observations)


def test_exposition_has_counters_histograms_and_gauges_and_gauges_disappear() -> None:
    state = TelemetryState()
    now = [T0 + 100]
    metrics = TelemetryMetrics(lambda: state.gauges(now[0]))
    try:
        state.apply(inventory(node("n0")), T0)
        feed(state, metrics, life(spec("a"), {"n0": [0]}, 0, 42, 600, end=ExitReason.OOM_KILLED))
        feed(state, metrics, life(spec("b", team="team-b"), {"n0": [1]}, 0, 5, 1, end=None))
        text = metrics.render().decode()
        assert 'gpuq_oom_kills_total{queue="team-a",team="team-a"} 1.0' in text
        assert 'gpuq_admission_wait_seconds_bucket{le="60",priority_class="normal",queue="team-a"} 1.0' in text
        assert 'gpuq_admission_wait_seconds_bucket{le="30",priority_class="normal",queue="team-a"} 0.0' in text
        assert 'gpuq_job_completion_seconds_count{exit_reason="OOMKilled",priority_class="normal",queue="team-a"}' \
            in text
        assert "# TYPE gpuq_gpu_allocated_seconds_total counter" in text
        assert 'gpuq_running_jobs{queue="team-b",team="team-b"} 1.0' in text
        assert "otel_scope_name" not in text
        metrics.record(state.apply(JobCancelled(job_id="b", by="x"), T0 + 50).observations)
        text = metrics.render().decode()
        assert "gpuq_running_jobs{" not in text  # no stale series once the job is gone
        assert 'gpuq_jobs_finished_total{exit_reason="Cancelled",queue="team-b",team="team-b"} 1.0' in text
    finally:
        metrics.shutdown()


def test_http_endpoint_serves_metrics_on_the_configured_port() -> None:
    state = TelemetryState()
    state.apply(inventory(node("n0")), T0)
    metrics = TelemetryMetrics(lambda: state.gauges(T0))
    try:
        port = metrics.serve(0, "127.0.0.1")
        resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert resp.status_code == 200
        assert 'gpuq_gpus_capacity{gpu_model="H100",pool="training"} 8.0' in resp.text
    finally:
        metrics.shutdown()


def test_a_batch_recorded_summed_reads_as_the_events_recorded_one_by_one() -> None:
    """Telemetry records a consumed batch's observations once at its end (the metrics layer adds each counter
    series' increments to its total): the exposition is the one the events recorded one by one give."""
    events = [*life(spec("a"), {"n0": [0]}, 0, 42, 600, end=ExitReason.OOM_KILLED),
              *life(spec("b", team="team-b"), {"n0": [1]}, 0, 5, 1, end=ExitReason.SUCCEEDED),
              *life(spec("c"), {"n0": [2]}, 1, 7, 30, end=ExitReason.SUCCEEDED)]
    texts = []
    for batched in (False, True):
        state = TelemetryState()
        state.apply(inventory(node("n0")), T0)
        metrics = TelemetryMetrics(functools.partial(state.gauges, T0 + 1000))
        try:
            observations = []
            for t, p in sorted(events, key=lambda e: e[0]):
                fx = state.apply(p, T0 + t)
                if batched:
                    observations += fx.observations
                else:
                    metrics.record(fx.observations)
            if batched:
                assert len({(o.name, o.labels) for o in observations}) < len(observations)  # series repeat
                metrics.record(observations)
            texts.append([line for line in metrics.render().decode().splitlines() if "_created" not in line])
        finally:
            metrics.shutdown()
    assert texts[0] == texts[1]
    assert any(line.startswith("gpuq_jobs_finished_total") for line in texts[1])


def test_job_ids_are_kept_out_of_metrics_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """/metrics is open to whoever reaches it: the per-job gauges, labelled with every team's job ids, are exported
    only with GPUQ_METRICS_JOB_LABELS (or job_labels=True); the per-queue series are there either way (issue 43)."""
    from services.telemetry.app import TelemetryService

    monkeypatch.delenv(JOB_LABELS_ENV, raising=False)
    bodies = {}
    for name, service in (("default", lambda: TelemetryService(metrics_port=None, webhook_worker=False)),
                          ("asked", lambda: TelemetryService(metrics_port=None, webhook_worker=False,
                                                             job_labels=True))):
        svc = service()
        try:
            svc.apply(inventory(node("n0")), T0)
            for t, p in life(spec("secret-project-7"), {"n0": [0]}, t_submit=0, wait=60, run=3600, end=None):
                svc.apply(p, T0 + t)
            svc.apply(life(spec("waiting-9"), {}, t_submit=0, wait=9000, run=1, end=None)[1][1], T0 + 1)
            bodies[name] = svc.metrics.render().decode()
        finally:
            svc.metrics.shutdown()
    assert "job_id" not in bodies["default"] and "secret-project-7" not in bodies["default"]
    assert 'gpuq_running_jobs{queue="team-a",team="team-a"} 1.0' in bodies["default"]
    assert 'job_id="secret-project-7"' in bodies["asked"] and 'job_id="waiting-9"' in bodies["asked"]


def test_the_job_labels_setting_names_a_bad_value() -> None:
    assert job_labels_from_env({}) is False and job_labels_from_env({JOB_LABELS_ENV: "true"}) is True
    with pytest.raises(ValueError, match="GPUQ_METRICS_JOB_LABELS must be true or false, not 'maybe'"):
        job_labels_from_env({JOB_LABELS_ENV: "maybe"})
