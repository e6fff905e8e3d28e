"""The DCGM source's pure core: reading series, attributing them to jobs, and deciding GPU health."""

from __future__ import annotations

import pytest

from services.core.executor.attribution import JobShare, Placements, attribute
from services.core.executor.dcgm_series import DcgmField, Device, parse_results, queries
from services.core.executor.gpu_health import HealthChange, HealthMemory, HealthPolicy, assess
from shared.config import DcgmLabels, DcgmSettings
from shared.domain import MigLayout, NodeHealth, NodeSpec
from tests.unit.executor.dcgm_builders import busy, gpu, node, results, series

LABELS = DcgmLabels()
POLICY = HealthPolicy(ignore_xids=frozenset({13, 31, 43, 45, 68, 109}), missing_gpu_polls=2, recovery_polls=2)
MIG = MigLayout(profile="1g.10gb", slices_per_gpu=7)


# --------------------------------------------------------------------------- queries and parsing


def test_queries_average_over_the_window_and_take_the_worst_xid() -> None:
    qs = queries(DcgmSettings(prometheus_url="http://p:9090", interval_s=15, selector='job="dcgm"'))
    assert qs[DcgmField.GR_ENGINE_ACTIVE] == 'avg_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE{job="dcgm"}[30s])'
    assert qs[DcgmField.XID] == 'max_over_time(DCGM_FI_DEV_XID_ERRORS{job="dcgm"}[30s])'
    assert set(qs) == set(DcgmField)
    assert queries(DcgmSettings(prometheus_url="http://p", lookback_s=60))[DcgmField.FB_USED] == \
        "avg_over_time(DCGM_FI_DEV_FB_USED[60s])"


def test_series_fold_into_devices_with_pod_labels_and_mig_instances() -> None:
    parsed = parse_results(results([
        (gpu("n1", 0, pod=("team-a", "job-1-main-0"), exported=True), busy(0.9)),
        (gpu("n1", 1, host_label="hostname"), busy(0.1)),  # the 2026 label name
        (gpu("m1", 2, instance=7, profile="1g.10gb"), busy(0.5)),
    ]), LABELS)
    a = parsed.readings[Device("n1", 0)]
    assert a.pod == ("team-a", "job-1-main-0")  # exported_* wins over the exporter's own pod label
    assert a.values[DcgmField.GR_ENGINE_ACTIVE] == 0.9 and a.uuid == "GPU-n1-0"
    assert parsed.readings[Device("n1", 1)].pod is None
    mig = parsed.readings[Device("m1", 2, 7)]
    assert mig.profile == "1g.10gb" and mig.values[DcgmField.FB_USED] == 40_000
    assert parsed.series == 3 * 6 and not parsed.dropped


def test_unusable_series_are_dropped_and_counted_never_guessed() -> None:
    raw = {DcgmField.GR_ENGINE_ACTIVE: [
        series({"gpu": "0"}, 0.5),  # no node label
        series({"Hostname": "n1"}, 0.5),  # no gpu label
        series({"Hostname": "n1", "gpu": "x"}, 0.5),
        series({"Hostname": "n1", "gpu": "0", "GPU_I_ID": "?"}, 0.5),
        series({"Hostname": "n1", "gpu": "0"}, "NaN"),
        series({"Hostname": "n1", "gpu": "0"}, -1),
        {"metric": {"Hostname": "n1", "gpu": "0"}},
        series({"Hostname": "n1", "gpu": "1", "pod": "", "namespace": ""}, 0.25),  # empty pod labels = none
    ]}
    parsed = parse_results(raw, LABELS)
    assert parsed.series == 8 and sum(parsed.dropped.values()) == 7
    assert parsed.dropped == {"no node label": 1, "no gpu label": 2, "bad GPU instance label": 1,
                              "value not finite or negative": 2, "no value": 1}
    assert list(parsed.readings) == [Device("n1", 1)] and parsed.readings[Device("n1", 1)].pod is None


def test_label_names_are_configurable() -> None:
    names = DcgmLabels(node=("kubernetes_node",), gpu="gpu_index")
    parsed = parse_results({DcgmField.GR_ENGINE_ACTIVE: [series({"kubernetes_node": "n9", "gpu_index": "3"}, 1)]},
                           names)
    assert list(parsed.readings) == [Device("n9", 3)]


# --------------------------------------------------------------------------- attribution


def test_pod_labels_then_device_join_then_uuid_else_unattributed() -> None:
    parsed = parse_results(results([
        (gpu("n1", 0, pod=("team-a", "a-main-0")), busy(0.9, tensor=0.4)),
        (gpu("n1", 1), busy(0.8)),  # no pod labels: the executor's (node, gpu) placement
        (gpu("n1", 2, uuid="GPU-abc"), busy(0.7)),  # placement known by UUID only
        (gpu("n1", 3, pod=("other", "not-ours")), busy(0.6)),  # a pod gpuq does not run: nobody's
        (gpu("n1", 4), busy(0.0, fb=0)),  # free GPU
    ]), LABELS)
    placements = Placements(pods={("team-a", "a-main-0"): "a"}, devices={Device("n1", 1): "b"},
                            uuids={("GPU-abc", None): "c"}, nodes={"n1": (JobShare("a", 1), JobShare("b", 1))})
    out = attribute(parsed, placements, {"n1": node("n1")})
    by_gpu = {s.gpu_index: s for s in out.batches[0].samples}
    assert [by_gpu[i].job_id for i in range(5)] == ["a", "b", "c", None, None]
    assert by_gpu[0].utilization_pct == pytest.approx(90) and by_gpu[0].tensor_active_pct == pytest.approx(40)
    assert by_gpu[0].memory_used_mib == 40_000 and by_gpu[0].fb_free_mib == 40_000 and by_gpu[0].power_w == 500
    assert by_gpu[0].gpu_uuid == "GPU-n1-0" and not any(s.approximate for s in by_gpu.values())
    assert (out.exact, out.approximate, out.unattributed) == (3, 0, 2)
    assert out.batches[0].gpu_model == "H100-80GB"


def test_gpu_util_is_the_fallback_for_whole_gpus_only() -> None:
    parsed = parse_results(results([
        (gpu("n1", 0), {DcgmField.GPU_UTIL: 55.0}),  # no profiling metrics on this GPU
        (gpu("m1", 0, instance=1), {DcgmField.GPU_UTIL: 55.0}),  # not meaningful for a MIG instance
    ]), LABELS)
    out = attribute(parsed, Placements(), {"n1": node("n1"), "m1": node("m1", mig=MIG)})
    assert [(b.node, [s.utilization_pct for s in b.samples]) for b in out.batches] == [("n1", [55.0])]
    assert out.no_utilisation == 1


def test_mig_instances_are_units_and_share_their_gpu_power() -> None:
    parsed = parse_results(results([
        (gpu("m1", 0), {DcgmField.POWER: 350.0, DcgmField.TEMP: 61.0, DcgmField.GR_ENGINE_ACTIVE: 0.9}),
        (gpu("m1", 0, instance=0, profile="1g.10gb"), {DcgmField.GR_ENGINE_ACTIVE: 0.8, DcgmField.FB_USED: 9000}),
        (gpu("m1", 0, instance=1, profile="3g.40gb"), {DcgmField.GR_ENGINE_ACTIVE: 0.2, DcgmField.FB_USED: 100}),
    ]), LABELS)
    placements = Placements(devices={Device("m1", 0, 0): "small", Device("m1", 0, 1): "big"})
    out = attribute(parsed, placements, {"m1": node("m1", gpus=1, mig=MIG)})
    samples = out.batches[0].samples
    assert [(s.job_id, s.gpu_instance, s.mig_profile) for s in samples] == [
        ("small", 0, "1g.10gb"), ("big", 1, "3g.40gb")]  # the parent series is no unit of its own
    assert samples[0].power_w == pytest.approx(350 * 0.142) and samples[1].power_w == pytest.approx(350 * 0.428)
    assert samples[0].temperature_c == 61.0 and samples[0].utilization_pct == pytest.approx(80)


def test_node_level_split_is_approximate_and_gives_every_job_the_same_mean() -> None:
    # Kubernetes without pod labels: the executor knows only that a (4 GPUs) and b (2 GPUs) run on n1.
    parsed = parse_results(results([
        (gpu("n1", 0), busy(0.9, fb=70_000)), (gpu("n1", 1), busy(0.9, fb=70_000)),
        (gpu("n1", 2), busy(0.9, fb=70_000)), (gpu("n1", 3), busy(0.9, fb=70_000)),
        (gpu("n1", 4), busy(0.0, fb=2_000)), (gpu("n1", 5), busy(0.0, fb=2_000)),
        (gpu("n1", 6), busy(0.0, fb=0, power=60)), (gpu("n1", 7), busy(0.0, fb=0, power=60)),
    ]), LABELS)
    placements = Placements(nodes={"n1": (JobShare("b", 2), JobShare("a", 4))})
    out = attribute(parsed, placements, {"n1": node("n1")})
    samples = {s.gpu_index: s for s in out.batches[0].samples}
    jobs = sorted((s.job_id or "-") for s in samples.values())
    assert jobs == ["-", "-", "a", "a", "a", "a", "b", "b"]
    taken = [s for s in samples.values() if s.job_id]
    assert {s.gpu_index for s in taken} == {0, 1, 2, 3, 4, 5}  # the GPUs holding memory, not the free ones
    assert all(s.approximate for s in taken) and not any(s.approximate for s in samples.values() if not s.job_id)
    assert {round(s.utilization_pct, 6) for s in taken} == {60.0}  # (4 × 90 + 2 × 0) / 6
    assert (out.exact, out.approximate, out.unattributed) == (0, 6, 2)


def test_a_job_known_per_device_never_borrows_a_free_gpu_in_a_split() -> None:
    # Job a holds GPUs 0 and 1; GPU 1 has no series (fell off the bus): GPU 2's numbers must not stand in.
    parsed = parse_results(results([(gpu("n1", 0), busy(0.9)), (gpu("n1", 2), busy(0.0, fb=0))]), LABELS)
    placements = Placements(devices={Device("n1", 0): "a", Device("n1", 1): "a"}, nodes={"n1": (JobShare("a", 2),)})
    out = attribute(parsed, placements, {"n1": node("n1")})
    assert [(s.gpu_index, s.job_id, s.approximate) for s in out.batches[0].samples] == [(0, "a", False),
                                                                                       (2, None, False)]


def test_unknown_nodes_are_reported_not_sampled() -> None:
    parsed = parse_results(results([(gpu("ghost", 0), busy(0.5))]), LABELS)
    out = attribute(parsed, Placements(), {"n1": node("n1")})
    assert out.batches == [] and out.unknown_nodes == ["ghost"]


def test_attribution_does_not_depend_on_series_order() -> None:
    devices = [(gpu("n1", i), busy(0.1 * i, fb=1000 * i)) for i in range(8)]
    placements = Placements(nodes={"n1": (JobShare("a", 3), JobShare("b", 2))})
    one = attribute(parse_results(results(devices), LABELS), placements, {"n1": node("n1")})
    two = attribute(parse_results(results(devices[::-1]), LABELS), placements, {"n1": node("n1")})
    assert one.batches == two.batches


# --------------------------------------------------------------------------- health


Devices = list[tuple[dict[str, str], dict[DcgmField, float]]]


def poll(memory: HealthMemory, devices: Devices,
         nodes: dict[str, NodeSpec] | None = None) -> tuple[HealthMemory, list[HealthChange]]:
    return assess(parse_results(results(devices), LABELS), nodes or {"n1": node("n1", gpus=2)}, memory, POLICY)


def test_an_xid_degrades_the_node_and_application_xids_do_not() -> None:
    memory, changes = poll(HealthMemory(), [(gpu("n1", 0), busy(0.5, xid=13)), (gpu("n1", 1), busy(0.5))])
    assert changes == []  # XID 13: the application's fault
    memory, changes = poll(memory, [(gpu("n1", 0), busy(0.5)), (gpu("n1", 1), busy(0.5, xid=79))])
    assert len(changes) == 1 and changes[0].node.health is NodeHealth.DEGRADED and changes[0].reason == "Xid79"
    assert "XID 79 (GPU has fallen off the bus) on GPU 1" in changes[0].message
    assert memory.degraded == {"n1": ("Xid79", changes[0].message)}
    memory, changes = poll(memory, [(gpu("n1", 0), busy(0.5)), (gpu("n1", 1), busy(0.5, xid=79))])
    assert changes == []  # still degraded: no second change


def test_the_node_recovers_after_clean_polls_only() -> None:
    memory = HealthMemory(degraded={"n1": ("Xid48", "XID 48")})
    clean = [(gpu("n1", 0), busy(0.5)), (gpu("n1", 1), busy(0.5))]
    memory, changes = poll(memory, clean)
    assert changes == [] and memory.clean_streak == {"n1": 1}
    memory, changes = poll(memory, [])  # no series at all: not assessed, the streak is kept
    assert changes == [] and memory.clean_streak == {"n1": 1}
    memory, changes = poll(memory, clean)
    assert [c.node.health for c in changes] == [NodeHealth.READY] and "was Xid48" in changes[0].message
    assert memory.degraded == {} and memory.clean_streak == {}


def test_a_gpu_missing_for_several_polls_has_fallen_off_the_bus() -> None:
    only_gpu0 = [(gpu("n1", 0), busy(0.5))]
    memory, changes = poll(HealthMemory(), only_gpu0)
    assert changes == [] and memory.missing_streak == {("n1", 1): 1}
    memory, changes = poll(memory, only_gpu0)
    assert [(c.node.name, c.reason) for c in changes] == [("n1", "GpuMissing")]
    assert "GPU 1 has reported no DCGM series for 2 polls" in changes[0].message


def test_an_exporter_that_is_down_says_nothing_about_the_gpus() -> None:
    memory, changes = poll(HealthMemory(), [])
    memory, changes = poll(memory, [])
    assert changes == [] and memory.missing_streak == {}


def test_only_ready_nodes_are_degraded() -> None:
    cordoned = node("n1", gpus=1).model_copy(update={"health": NodeHealth.CORDONED})
    memory, changes = poll(HealthMemory(), [(gpu("n1", 0), busy(0.5, xid=48))], {"n1": cordoned})
    assert changes == [] and memory.degraded == {}


def test_a_job_holding_every_gpu_of_its_node_owns_each_one_exactly() -> None:
    # Kubernetes without pod labels: the device plugin chose the GPUs, but the job holds all 8 of n1.
    devices = [(gpu("n1", i), busy(0.1 * i, fb=1000 * i)) for i in range(8)]
    out = attribute(parse_results(results(devices), LABELS), Placements(nodes={"n1": (JobShare("a", 8),)}),
                    {"n1": node("n1")})
    samples = out.batches[0].samples
    assert [(s.gpu_index, s.job_id, s.approximate) for s in samples] == [(i, "a", False) for i in range(8)]
    assert [s.utilization_pct for s in samples] == pytest.approx([10.0 * i for i in range(8)])  # each its own
    assert (out.exact, out.approximate, out.unattributed) == (8, 0, 0)
    # A GPU without series (it fell off the bus) takes nothing from the others: the 7 left are still the job's.
    out = attribute(parse_results(results(devices[1:]), LABELS), Placements(nodes={"n1": (JobShare("a", 8),)}),
                    {"n1": node("n1")})
    assert (out.exact, out.approximate) == (7, 0)


def test_holding_every_allocatable_gpu_is_not_enough_when_the_node_reports_more() -> None:
    # The device plugin hides an unhealthy GPU (allocatable 7) that DCGM still reports: which 7 are the job's is
    # unknown, so the node-level split applies.
    devices = [(gpu("n1", i), busy(0.5 if i else 0.0, fb=40_000 if i else 0)) for i in range(8)]
    out = attribute(parse_results(results(devices), LABELS), Placements(nodes={"n1": (JobShare("a", 7),)}),
                    {"n1": node("n1", gpus=7)})
    assert (out.exact, out.approximate, out.unattributed) == (0, 7, 1)


def test_a_job_holding_every_mig_slice_of_its_node_owns_each_one_exactly() -> None:
    devices = [(gpu("m1", 0), {DcgmField.POWER: 350.0}),
               *((gpu("m1", 0, instance=i + 7), busy(0.1 * i, fb=1000)) for i in range(7))]
    out = attribute(parse_results(results(devices), LABELS), Placements(nodes={"m1": (JobShare("nb", 7),)}),
                    {"m1": node("m1", gpus=1, mig=MIG)})
    samples = out.batches[0].samples
    assert [(s.gpu_instance, s.job_id, s.approximate) for s in samples] == [(i + 7, "nb", False) for i in range(7)]
    # Two jobs on the node: which slice is whose is unknown without pod labels (approximate).
    shared = Placements(nodes={"m1": (JobShare("nb", 5), JobShare("other", 2))})
    out = attribute(parse_results(results(devices), LABELS), shared, {"m1": node("m1", gpus=1, mig=MIG)})
    assert (out.exact, out.approximate) == (0, 7)


def test_units_by_node_counts_whole_gpus_and_mig_slices() -> None:
    from services.core.executor.attribution import units_by_node
    from shared.domain import GpuBinding

    placed = [("b", [GpuBinding(pod="main-0", node="n1", gpu_indices=(0, 1)),
                     GpuBinding(pod="main-1", node="n2", gpu_indices=(0, 1, 2, 3))]),
              ("a", [GpuBinding(pod="nb-0", node="m1", mig_slice=(0, 3)), GpuBinding(pod="nb-1", node="m1",
                                                                                     mig_slice=(0, 4))]),
              ("c", [GpuBinding(pod="cpu-0", node="n1")])]  # no GPU: no share
    assert units_by_node(placed) == {"m1": (JobShare("a", 2),), "n1": (JobShare("b", 2),),
                                     "n2": (JobShare("b", 4),)}


def test_a_verdict_outlives_the_nodes_absence_and_ends_with_clean_polls_only() -> None:
    clean = [(gpu("n1", 0), busy(0.5)), (gpu("n1", 1), busy(0.5))]
    memory = HealthMemory(degraded={"n1": ("Xid48", "XID 48")})
    # The executor does not list n1 for a while (removed and registered again, or not yet relisted).
    memory, changes = poll(memory, clean, nodes={"n2": node("n2", gpus=2)})
    assert changes == [] and memory.degraded == {"n1": ("Xid48", "XID 48")}
    memory, changes = poll(memory, clean)
    memory, changes = poll(memory, clean)
    assert [(c.node.name, c.node.health) for c in changes] == [("n1", NodeHealth.READY)]
