"""Telemetry of real GPU data: MIG instances, degraded nodes, MFU and its proxy, the utilisation source's health."""

from __future__ import annotations

import pytest

from services.core.telemetry.state import FLOPS_REPORT_MAX_AGE_S, Observation, TelemetryState, labels
from shared.config import parse_queues
from shared.domain import GpuBinding, JobSpec, MigLayout, NodeHealth, PodSet, Precision
from shared.events import (
    GpuSample,
    JobFlopsReported,
    JobPlaced,
    JobStarted,
    NodeChanged,
    Payload,
    UtilizationSampled,
    UtilizationSourceChecked,
)
from tests.unit.telemetry.telemetry_builders import T0, at, bindings, inventory, life, node, spec

QUEUES = parse_queues({"priority_classes": [{"name": "normal", "value": 1}],
                       "queues": [{"name": "team-a"}, {"name": "team-b"}],
                       "gpu_flavors": {"H100": {"peak_tflops": {"bf16": 1000}}}})


def run(state: TelemetryState, events: list[tuple[float, Payload]]) -> list[Observation]:
    out: list[Observation] = []
    for t, p in sorted(events, key=lambda e: e[0]):
        out.extend(state.apply(p, T0 + t).observations)
    return out


def running(state: TelemetryState, job_id: str, team: str = "team-a", gpus: int = 4) -> None:
    s = spec(job_id, team=team, gpus_per_pod=gpus)
    run(state, life(s, {f"n-{job_id}": list(range(gpus))}, t_submit=0, wait=10, run=1, end=None))


def flops(job_id: str, tflops: float, t: float) -> JobFlopsReported:
    return JobFlopsReported(job_id=job_id, achieved_tflops=tflops, precision=Precision.BF16, reported_at=at(t))


def report(s: TelemetryState, job_id: str, tflops: float, t: float, team: str = "team-a") -> list[Observation]:
    """A report as it arrives on `team`'s subject."""
    return s.apply(flops(job_id, tflops, t), T0 + t, scope=team).observations


def test_mig_instances_count_their_slice_of_the_gpu() -> None:
    s = TelemetryState()
    mig = node("m0", gpus=1).model_copy(update={"mig": MigLayout(profile="1g.10gb", slices_per_gpu=7)})
    s.apply(inventory(mig), T0)
    nb = JobSpec(job_id="nb", team="team-a", queue="team-a",
                 pod_sets=(PodSet(name="nb", count=2, mig_profile="1g.10gb"),))
    s.apply(JobPlaced(job_id="nb", spec=nb, placed_at=at(0), bindings=(
        GpuBinding(pod="nb-0", node="m0", mig_slice=(0, 0)), GpuBinding(pod="nb-1", node="m0", mig_slice=(0, 1)))),
        T0)
    s.apply(JobStarted(job_id="nb", started_at=at(1)), T0 + 1)
    obs = s.apply(UtilizationSampled(node="m0", gpu_model="H100", sampled_at=at(10), interval_s=10, samples=(
        GpuSample(job_id="nb", gpu_index=0, gpu_instance=0, mig_profile="1g.10gb", utilization_pct=100,
                  tensor_active_pct=50),
        GpuSample(job_id="nb", gpu_index=0, gpu_instance=1, mig_profile="1g.10gb", utilization_pct=50),
        GpuSample(gpu_index=0, gpu_instance=2, mig_profile="1g.10gb", utilization_pct=0))), T0 + 10).observations
    allocated = sum(o.value for o in obs if o.name == "gpuq_gpu_allocated_seconds")
    used = sum(o.value for o in obs if o.name == "gpuq_gpu_used_seconds")
    assert allocated == pytest.approx(2 * 10 * 0.142) and used == pytest.approx(10 * 0.142 * 1.5)
    g = s.gauges(T0 + 10)
    gpu = labels(node="m0", gpu="0", pool="training", gpu_model="H100")
    assert g["gpuq_node_gpu_utilization_ratio"][gpu] == pytest.approx(0.142 * 1.5)  # the physical GPU, not 150%
    assert g["gpuq_node_gpu_tensor_active_ratio"][gpu] == pytest.approx(0.142 * 0.5)
    team = labels(queue="team-a", team="team-a", pool="training", gpu_model="H100")
    assert g["gpuq_gpus_used"][team] == pytest.approx(0.142 * 1.5)
    # The job's own figures are of its slices: the mean of its two instances.
    assert g["gpuq_job_gpu_utilization_ratio"][labels(job_id="nb", queue="team-a", team="team-a")] == 0.75


def test_a_degraded_node_leaves_capacity_and_shows_with_its_reason() -> None:
    s = TelemetryState()
    s.apply(inventory(node("n0"), node("n1")), T0)
    s.apply(NodeChanged(node=node("n1", health=NodeHealth.DEGRADED), reason="Xid79",
                        message="XID 79 (GPU has fallen off the bus) on GPU 3"), T0 + 1)
    g = s.gauges(T0 + 2)
    assert g["gpuq_node_degraded"] == {labels(node="n1", pool="training", gpu_model="H100", reason="Xid79"): 1}
    assert g["gpuq_nodes"][labels(pool="training", gpu_model="H100", health="degraded")] == 1
    assert g["gpuq_gpus_capacity"][labels(pool="training", gpu_model="H100")] == 8
    s.apply(NodeChanged(node=node("n1"), message="ready again"), T0 + 3)
    assert "gpuq_node_degraded" not in s.gauges(T0 + 4)


def test_mfu_from_reports_and_the_tensor_proxy_otherwise() -> None:
    s = TelemetryState()
    s.set_queues(QUEUES)
    s.apply(inventory(node("n-a"), node("n-b")), T0)
    running(s, "a", gpus=4)
    running(s, "b", team="team-b", gpus=2)
    s.apply(UtilizationSampled(node="n-b", gpu_model="H100", sampled_at=at(100), interval_s=30, samples=tuple(
        GpuSample(job_id="b", gpu_index=g, utilization_pct=90, tensor_active_pct=30 + 20 * g) for g in range(2))),
        T0 + 100)
    # Another team's credential cannot report for team-a's job; without a subject nobody can.
    assert [o.labels for o in report(s, "a", 1600.0, 90, team="team-b")] == [labels(reason="WrongTeam")]
    assert [o.labels for o in s.apply(flops("a", 1600.0, 95), T0 + 95).observations] == [labels(reason="WrongTeam")]
    assert "gpuq_job_mfu_ratio" not in s.gauges(T0 + 96)
    assert report(s, "a", 1600.0, 100) == []  # 4 × 1000 peak: MFU 0.4
    g = s.gauges(T0 + 110)
    assert g["gpuq_job_mfu_ratio"] == {labels(job_id="a", queue="team-a", team="team-a", precision="bf16"): 0.4}
    assert g["gpuq_mfu_ratio"] == {labels(queue="team-a", team="team-a"): 0.4}
    assert g["gpuq_job_tensor_active_ratio"] == {labels(job_id="b", queue="team-b", team="team-b"): 0.4}
    assert g["gpuq_gpus_tensor_active"][labels(queue="team-b", team="team-b", pool="training",
                                                gpu_model="H100")] == pytest.approx(0.8)
    # An older report arriving late changes nothing; a report above the peak is refused, never shown.
    report(s, "a", 800.0, 50)
    obs = report(s, "a", 4100.0, 130)
    assert [(o.name, o.labels) for o in obs] == [("gpuq_flops_reports_rejected", labels(reason="AbovePeak"))]
    assert s.gauges(T0 + 130)["gpuq_job_mfu_ratio"][labels(job_id="a", queue="team-a", team="team-a",
                                                            precision="bf16")] == 0.4
    # A job that stops reporting shows no MFU after a while.
    assert "gpuq_job_mfu_ratio" not in s.gauges(T0 + 100 + FLOPS_REPORT_MAX_AGE_S + 1)
    obs = report(s, "ghost", 1.0, 140)
    assert [o.labels for o in obs] == [labels(reason="NotRunning")]


def test_mfu_follows_the_placement_and_a_changed_peak() -> None:
    s = TelemetryState()
    s.set_queues(QUEUES)
    s.apply(inventory(node("n-a")), T0)
    running(s, "a", gpus=2)
    report(s, "a", 500.0, 100)
    key = labels(job_id="a", queue="team-a", team="team-a", precision="bf16")
    assert s.gauges(T0 + 100)["gpuq_job_mfu_ratio"][key] == 0.25
    s.set_queues(parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "team-a"}],
                               "gpu_flavors": {"H100": {"peak_tflops": {"bf16": 500}}}}))
    assert s.gauges(T0 + 100)["gpuq_job_mfu_ratio"][key] == 0.5
    # Placed again elsewhere (after a preemption): the old report was for other GPUs.
    a = spec("a", gpus_per_pod=2)
    s.apply(JobPlaced(job_id="a", spec=a, bindings=bindings(a, {"n-a": [4, 5]}), placed_at=at(200)), T0 + 200)
    assert "gpuq_job_mfu_ratio" not in s.gauges(T0 + 200)


def test_the_source_is_up_while_it_polls_successfully_and_recently() -> None:
    s = TelemetryState()

    def checked(t: float, ok: bool, reason: str | None = None) -> list[Observation]:
        return s.apply(UtilizationSourceChecked(source="dcgm", endpoint="http://p:9090", ok=ok, reason=reason,
                                                checked_at=at(t), interval_s=15, gpus_exact=6, gpus_approximate=2,
                                                gpus_unattributed=8), T0 + t).observations

    assert checked(0, True) == []
    g = s.gauges(T0 + 10)
    assert g["gpuq_utilization_source_up"] == {labels(source="dcgm"): 1.0}
    assert g["gpuq_utilization_source_last_success_timestamp_seconds"] == {labels(source="dcgm"): T0}
    assert g["gpuq_utilization_source_gpus"][labels(source="dcgm", attribution="approximate")] == 2
    obs = checked(15, False, "Unreachable")
    assert [(o.name, o.labels) for o in obs] == [("gpuq_utilization_source_failures",
                                                  labels(reason="Unreachable", source="dcgm"))]
    g = s.gauges(T0 + 16)
    assert g["gpuq_utilization_source_up"] == {labels(source="dcgm"): 0.0}
    assert g["gpuq_utilization_source_last_success_timestamp_seconds"] == {labels(source="dcgm"): T0}
    checked(30, True)
    checked(20, False, "Timeout")  # a late report of an older poll: ignored
    assert s.gauges(T0 + 31)["gpuq_utilization_source_up"] == {labels(source="dcgm"): 1.0}
    # Silence (the executor is gone) is not "up": after three intervals without a poll the source is down.
    assert s.gauges(T0 + 30 + 46)["gpuq_utilization_source_up"] == {labels(source="dcgm"): 0.0}
    # The record survives a restart (the shell persists it).
    rebuilt = TelemetryState()
    rebuilt.load_source(s.source_doc("dcgm") or {})
    assert rebuilt.gauges(T0 + 31)["gpuq_utilization_source_up"] == {labels(source="dcgm"): 1.0}
