"""What bound pods hold on their nodes: effective requests as kube-scheduler counts them, gpuq's pods apart."""

from __future__ import annotations

from typing import Any

import pytest

from services.core.kube.usage import NodeLoads, pod_load, still_refused, with_refusal
from shared.domain import NodeUsage, PlacementRefusal, PodShape


def pod(node: str | None = "n1", *, phase: str = "Running", labels: dict[str, str] | None = None,
        containers: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None,
        overhead: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers or []}
    if node:
        spec["nodeName"] = node
    if init:
        spec["initContainers"] = init
    if overhead:
        spec["overhead"] = overhead
    return {"metadata": {"name": "p", "namespace": "ns", "labels": labels or {}}, "spec": spec,
            "status": {"phase": phase}}


def res(limits: dict[str, str] | None = None, requests: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": "c", "resources": {"limits": limits or {}, "requests": requests or {}}}


def test_effective_requests_sum_containers_take_the_largest_init_and_add_overhead() -> None:
    load = pod_load(pod(containers=[res({"nvidia.com/gpu": "2"}, {"cpu": "500m", "memory": "1Gi"}),
                                    res({"nvidia.com/gpu": "1", "cpu": "1"})],  # requests default to limits
                        init=[res(requests={"cpu": "4", "memory": "512Mi"})], overhead={"cpu": "100m"}))
    assert load is not None
    assert (load.node, load.gpus, load.cpu_milli, load.memory_mib) == ("n1", 3, 4100, 1024)
    mig = pod_load(pod(containers=[res({"nvidia.com/mig-1g.10gb": "2"})]))
    assert mig is not None and mig.mig == (("1g.10gb", 2),) and mig.gpus == 0


@pytest.mark.parametrize("p", [pod(node=None), pod(phase="Succeeded"), pod(phase="Failed")])
def test_unbound_and_finished_pods_hold_nothing(p: dict[str, Any]) -> None:
    assert pod_load(p) is None


def test_node_loads_split_gpuqs_pods_from_the_others_and_follow_changes() -> None:
    loads = NodeLoads()
    serve = pod_load(pod(containers=[res({"nvidia.com/gpu": "4", "cpu": "2", "memory": "2Gi"})]))
    ours = pod_load(pod(labels={"gpuq.io/job": "abc"}, containers=[res({"nvidia.com/gpu": "2"})]))
    mig = pod_load(pod(containers=[res({"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-3g.40gb": "1"})]))
    assert loads.put("ns/serve", serve) == ("n1",)
    assert loads.put("ns/serve", serve) == ()  # unchanged: nothing to announce
    loads.put("ns/ours", ours)
    loads.put("ns/mig", mig)
    assert loads.held("n1", None) == NodeUsage(gpus=4, cpu_milli=2000, memory_mib=2048, pods=2)
    assert loads.held("n1", "1g.10gb").mig_slices == 1  # only the node's own profile
    assert loads.usage("n1", None).gpus == 6 and loads.usage("n1", None, but="abc").gpus == 4
    moved = pod_load(pod("n2", containers=[res({"nvidia.com/gpu": "4"})]))
    assert loads.put("ns/serve", moved) == ("n1", "n2")
    assert loads.held("n1", None).gpus == 0 and loads.held("n2", None).gpus == 4
    assert loads.put("ns/serve", None) == ("n2",) and loads.held("n2", None) == NodeUsage()


def test_a_malformed_quantity_is_named() -> None:
    with pytest.raises(ValueError, match="'lots' is not a Kubernetes quantity"):
        pod_load(pod(containers=[res(requests={"cpu": "lots"})]))


def test_refusals_last_while_the_nodes_usage_is_unchanged_and_a_smaller_shape_covers_larger_ones() -> None:
    small = PlacementRefusal(shape=PodShape(gpus=2), reason="OutOfnvidia.com/gpu", job_id="a",
                             usage=NodeUsage(gpus=4, pods=1))
    big = PlacementRefusal(shape=PodShape(gpus=8), reason="Unschedulable", job_id="b", usage=NodeUsage(pods=1))
    assert with_refusal((), big) == (big,)
    assert with_refusal((big,), small) == (small,)  # 2 GPUs refused: 8 are refused too
    assert with_refusal((small,), big) == (small,)
    usage = {"a": NodeUsage(gpus=4, pods=1), "b": NodeUsage(pods=2)}  # b's node usage changed since
    assert still_refused((small, big), usage.__getitem__) == (small,)
