"""Node informer mapping: GPU Feature Discovery labels, mixed MIG, taints, NotReady."""

from __future__ import annotations

import pytest

from services.core.kube.nodes import node_spec, selected
from shared.config import KubernetesSource
from shared.domain import MigLayout, NodeHealth, Taint, TaintEffect
from tests.unit.executor_kube.conftest import node

TOPO = {"network.topology.nvidia.com/block": "b1", "network.topology.nvidia.com/rack": "r2"}


def test_gfd_labels_map_to_flavor_count_memory_pool_topology(kube_cfg: KubernetesSource) -> None:
    spec = node_spec(node("gpu-1", labels={**TOPO, "gpuq.io/pool": "training", "example.com/zone": "z1",
                                           "nvidia.com/gfd.timestamp": "1760000000"},
                          annotations={"gpuq.io/datasets": "imagenet, c4"}), kube_cfg)
    assert (spec.name, spec.gpus, spec.gpu_model) == ("gpu-1", 8, "H100-80GB")
    assert (spec.cpu_milli, spec.memory_mib) == (95500, 1056000)
    assert spec.rack == "b1/r2" and spec.block == "b1"
    assert spec.labels["pool"] == "training" and spec.labels["nvidia.com/gpu.memory"] == "81559"
    # every label jobs may select on, but those that change on every feature-discovery pass
    assert spec.labels["example.com/zone"] == "z1" and spec.labels["gpuq.io/pool"] == "training"
    assert "nvidia.com/gfd.timestamp" not in spec.labels
    prefixed = kube_cfg.model_copy(update={"ignored_labels": ("example.com/*",)})
    assert "example.com/zone" not in node_spec(node("gpu-1", labels={"example.com/zone": "z1"}), prefixed).labels
    assert spec.datasets == ("c4", "imagenet")
    assert spec.health is NodeHealth.READY and spec.mig is None


def test_unmapped_product_is_its_own_flavor_and_cpu_nodes_are_cpu(kube_cfg: KubernetesSource) -> None:
    other = node("a", labels={"nvidia.com/gpu.product": "NVIDIA-L4"})
    assert node_spec(other, kube_cfg).gpu_model == "NVIDIA-L4"
    cpu = node("c", gpus=0, allocatable={"cpu": "8", "memory": "32Gi"})
    del cpu["metadata"]["labels"]["nvidia.com/gpu.product"]
    spec = node_spec(cpu, kube_cfg)
    assert (spec.gpus, spec.gpu_model, spec.cpu_milli, spec.memory_mib) == (0, "cpu", 8000, 32768)


def test_mixed_mig_strategy_exposes_slices_of_the_partitioned_gpus(kube_cfg: KubernetesSource) -> None:
    mig = node("mig-0", gpus=8, allocatable={"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "56",
                                             "nvidia.com/mig-3g.40gb": "0", "cpu": "64", "memory": "512Gi"})
    spec = node_spec(mig, kube_cfg)
    assert spec.mig == MigLayout(profile="1g.10gb", slices_per_gpu=7) and spec.gpus == 8


def test_taints_are_kept_and_unschedulable_cordons(kube_cfg: KubernetesSource) -> None:
    spec = node_spec(node("t", taints=[{"key": "pool", "value": "inference", "effect": "NoSchedule"},
                                       {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
                          unschedulable=True), kube_cfg)
    assert spec.taints == (Taint(key="pool", value="inference", effect=TaintEffect.NO_SCHEDULE),)
    assert spec.health is NodeHealth.CORDONED


@pytest.mark.parametrize("ready,taint", [("False", None), ("Unknown", None),
                                         ("True", "node.kubernetes.io/unreachable")])
def test_not_ready_or_lifecycle_noexecute_taint_fails_the_node(kube_cfg: KubernetesSource, ready: str,
                                                               taint: str | None) -> None:
    taints = [{"key": taint, "effect": "NoExecute"}] if taint else []
    spec = node_spec(node("n", ready=ready, taints=taints), kube_cfg)
    assert spec.health is NodeHealth.FAILED and spec.taints == ()


def test_missing_topology_labels_isolate_the_node(kube_cfg: KubernetesSource) -> None:
    spec = node_spec(node("lonely"), kube_cfg)
    assert spec.rack == "~lonely" and spec.block == "~lonely"


def test_node_selector_and_malformed_quantities(kube_cfg: KubernetesSource) -> None:
    cfg = kube_cfg.model_copy(update={"node_selector": {"gpuq.io/managed": "true"}})
    assert not selected(node("x"), cfg) and selected(node("y", labels={"gpuq.io/managed": "true"}), cfg)
    with pytest.raises(ValueError, match="node bad: 'lots' is not a Kubernetes quantity"):
        node_spec(node("bad", allocatable={"nvidia.com/gpu": "8", "cpu": "lots"}), kube_cfg)
