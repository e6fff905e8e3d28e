"""Fragmentation = free GPUs that no waiting gang can use."""

from __future__ import annotations

from services.core.telemetry.fragmentation import fragmented_gpus
from shared.domain import JobSpec, NodeHealth, PodSet, Taint, Toleration
from tests.unit.telemetry.telemetry_builders import node, spec


def test_nothing_waiting_means_no_fragmentation() -> None:
    assert fragmented_gpus([node("a"), node("b")], {"a": 3, "b": 8}, []) == {"a": 0, "b": 0}


def test_leftovers_smaller_than_any_pod_are_fragmented() -> None:
    nodes = [node("a"), node("b")]
    free = {"a": 3, "b": 3}
    assert fragmented_gpus(nodes, free, [spec("w", gpus_per_pod=4)]) == {"a": 3, "b": 3}
    # Pods of 2 GPUs: each node offers 2 of its 3 free GPUs; one GPU per node is left over.
    assert fragmented_gpus(nodes, free, [spec("w", pods=2, gpus_per_pod=2)]) == {"a": 1, "b": 1}


def test_a_gang_that_cannot_fit_whole_uses_nothing() -> None:
    nodes = [node("a"), node("b"), node("c")]
    free = {"a": 4, "b": 4, "c": 1}
    assert fragmented_gpus(nodes, free, [spec("w", pods=3, gpus_per_pod=4)]) == {"a": 4, "b": 4, "c": 1}
    # A second, smaller gang makes a and b usable again.
    both = [spec("w", pods=3, gpus_per_pod=4), spec("v", pods=2, gpus_per_pod=4)]
    assert fragmented_gpus(nodes, free, both) == {"a": 0, "b": 0, "c": 1}


def test_model_taints_and_health_limit_what_a_gang_can_use() -> None:
    nodes = [node("h", model="H100"), node("l", model="L4"),
             node("t", taints=(Taint(key="pool", value="inference"),)),
             node("dead", health=NodeHealth.FAILED)]
    free = {"h": 8, "l": 8, "t": 8, "dead": 8}
    wants_h100 = spec("w", gpus_per_pod=8, models=("H100",))
    assert fragmented_gpus(nodes, free, [wants_h100]) == {"h": 0, "l": 8, "t": 8}
    tolerant = JobSpec(job_id="tol", team="a", queue="a",
                       pod_sets=(PodSet(count=1, gpus_per_pod=8, gpu_models=("H100",)),),
                       tolerations=(Toleration(key="pool", operator="Exists"),))
    assert fragmented_gpus(nodes, free, [tolerant]) == {"h": 0, "l": 8, "t": 0}


def test_mig_only_jobs_do_not_count_as_waiting_gangs() -> None:
    mig = JobSpec(job_id="m", team="a", queue="a", pod_sets=(PodSet(count=2, mig_profile="1g.10gb"),))
    assert fragmented_gpus([node("a")], {"a": 2}, [mig]) == {"a": 0}
