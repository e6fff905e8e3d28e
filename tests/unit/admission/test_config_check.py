"""The check of a proposed queue configuration (services/core/admission/configcheck.py): its diff, and which
mistakes it refuses against the live cluster and the jobs each queue holds."""

from __future__ import annotations

from typing import Any

from services.core.admission.configcheck import Inventory, QueueJobs, check_change, inventory_of
from services.core.admission.governance import gpu_request_violation, size_violation
from shared.config import QueuesConfig, parse_queues
from shared.domain import JobSpec, MigLayout, NodeSpec, PodSet

H100, A100 = "H100-80GB", "A100-40GB"


def config(quotas: dict[str, dict[str, int]], cohorts: list[dict[str, Any]] | None = None) -> QueuesConfig:
    return parse_queues({"priority_classes": [{"name": "normal", "value": 100}],
                         "cohorts": cohorts or [],
                         "queues": [{"name": q, "quotas": {m: {"nominal": n} for m, n in qs.items()}}
                                    for q, qs in quotas.items()]}, "test")


def nodes(count: int, model: str = H100, gpus: int = 8, mig: MigLayout | None = None) -> list[NodeSpec]:
    return [NodeSpec(name=f"{model}-{i}", gpus=gpus, gpu_model=model, cpu_milli=1000, memory_mib=1000, rack="r",
                     block="b", mig=mig) for i in range(count)]


CLUSTER = inventory_of(nodes(32))  # 256 H100


def test_a_guarantee_above_capacity_is_refused_and_one_within_it_is_not() -> None:
    old = config({"a": {H100: 8}, "b": {H100: 8}})
    over = check_change(old, config({"a": {H100: 1280}, "b": {H100: 8}}), CLUSTER, {})
    assert over.refusals == ("guaranteed H100-80GB sums to 1288 but the cluster has 256: guarantees cannot all be "
                             "honoured at once",)
    assert over.diff == ("~ queue a: H100-80GB 8 → 1280",)
    assert "--force" in over.reason()
    within = check_change(old, config({"a": {H100: 248}, "b": {H100: 8}}), CLUSTER, {})
    assert within.refusals == () and within.diff == ("~ queue a: H100-80GB 8 → 248",)


def test_cohort_pools_count_toward_the_guarantee() -> None:
    new = config({"a": {H100: 200}}, cohorts=[{"name": "org", "quotas": {H100: {"nominal": 100}}}])
    assert check_change(config({"a": {H100: 8}}), new, CLUSTER, {}).refused


def test_a_model_the_cluster_lacks_is_refused_when_new_and_a_warning_when_it_was_there_before() -> None:
    new = config({"a": {H100: 8, "B200": 8}})
    refused = check_change(config({"a": {H100: 8}}), new, CLUSTER, {})
    assert refused.refusals == ("quota for GPU model B200, which the cluster does not have (it has: H100-80GB)",)
    kept = check_change(new, config({"a": {H100: 16, "B200": 8}}), CLUSTER, {})
    assert kept.refusals == () and any("B200" in w for w in kept.warnings)


def test_a_cluster_that_shrank_under_the_guarantees_blocks_no_change_that_does_not_raise_them() -> None:
    old = config({"a": {H100: 200}, "b": {H100: 56}})
    small = inventory_of(nodes(2))
    same = check_change(old, config({"a": {H100: 200}, "b": {H100: 56}, "c": {}}), small, {})
    assert same.refusals == () and any("sums to 256 but the cluster has 16" in w for w in same.warnings)
    assert check_change(old, config({"a": {H100: 201}, "b": {H100: 56}}), small, {}).refused


def test_no_node_known_turns_capacity_refusals_into_a_warning() -> None:
    checked = check_change(None, config({"a": {H100: 1280, "B200": 8}}), Inventory(), {})
    assert checked.refusals == ()
    assert any("no node announced yet" in w for w in checked.warnings)


def test_removing_a_queue_with_jobs_is_refused_and_an_empty_one_is_not() -> None:
    old = config({"a": {H100: 8}, "b": {H100: 8}, "c": {H100: 8}})
    new = config({"a": {H100: 8}})
    checked = check_change(old, new, CLUSTER, {"b": QueueJobs(pending=2, admitted=1), "c": QueueJobs()})
    assert checked.refusals == ("removes queue b, which holds 1 admitted (running) and 2 pending job(s)",)
    assert checked.diff == ("- queue b", "- queue c")


def test_mig_slices_are_checked_against_the_slices_the_cluster_has() -> None:
    inv = inventory_of(nodes(2, A100, mig=MigLayout(profile="1g.5gb", slices_per_gpu=7)))
    assert inv.slices == {"A100-40GB:1g.5gb": 112} and inv.gpus == {A100: 16}
    assert not check_change(None, config({"a": {"A100-40GB:1g.5gb": 112}}), inv, {}).refused
    assert check_change(None, config({"a": {"A100-40GB:1g.5gb": 113}}), inv, {}).refused


def test_a_job_without_any_gpu_is_refused_and_a_cpu_pod_set_beside_gpu_pods_is_not() -> None:
    def job(*pod_sets: PodSet) -> JobSpec:
        return JobSpec(job_id="j", team="t", queue="t", pod_sets=pod_sets)

    none = job(PodSet(gpus_per_pod=0))
    violation = gpu_request_violation(none)
    assert violation is not None and violation.reason == "NoGpuRequested"
    assert "gpuq schedules GPU jobs" in violation.message
    assert size_violation(none) == violation  # every submission path checks it
    assert gpu_request_violation(job(PodSet(name="launcher", gpus_per_pod=0), PodSet(name="workers"))) is None
    assert gpu_request_violation(job(PodSet(gpus_per_pod=1, mig_profile="1g.5gb"))) is None
