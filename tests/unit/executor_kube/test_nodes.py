"""Node informer mapping: GPU Feature Discovery labels, mixed MIG, taints, NotReady."""

from __future__ import annotations

import pytest

from services.core.kube.nodes import node_spec, selected
from shared.config import KubernetesSource
from shared.domain import GpuSharing, MigLayout, NodeHealth, SharingMode, Taint, TaintEffect
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


# ----------------------------------------------------------------------------- sharing and mixed MIG (issue 47)

def test_time_sliced_replicas_are_shared_gpus_not_whole_ones(kube_cfg: KubernetesSource) -> None:
    # GFD on a time-sliced node: 8 GPUs advertised 4 times each, the product suffixed -SHARED (not renamed)
    sliced = node("ts", gpus=8, labels={"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy":
                                        "time-slicing", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED"},
                  allocatable={"nvidia.com/gpu": "32", "cpu": "64", "memory": "512Gi"})
    spec = node_spec(sliced, kube_cfg)
    assert spec.gpus == 8 and spec.gpu_model == "H100-80GB"  # not 32 whole GPUs of a "-SHARED" flavor
    assert spec.sharing == GpuSharing(mode=SharingMode.TIME_SLICING, replicas=4, resource="nvidia.com/gpu",
                                      gpu_memory_mib=81559)
    assert spec.shared_gpus == 8 and spec.mig is None and spec.mig_profiles == {}


def test_renamed_replicas_mps_from_older_gfd_and_strategy_none(kube_cfg: KubernetesSource) -> None:
    # renameByDefault: nvidia.com/gpu.shared; an older GFD writes no strategy label, mps.capable says MPS
    renamed = node("mps", gpus=4, labels={"nvidia.com/gpu.replicas": "10", "nvidia.com/mps.capable": "true"},
                   allocatable={"nvidia.com/gpu.shared": "40", "cpu": "64", "memory": "512Gi"})
    spec = node_spec(renamed, kube_cfg)
    assert spec.sharing is not None and spec.gpus == 4
    assert (spec.sharing.mode, spec.sharing.resource, spec.sharing.replicas) == (SharingMode.MPS,
                                                                                "nvidia.com/gpu.shared", 10)
    # some GPUs renamed-shared, others still whole: both counted, the shared ones said
    partly = node("part", gpus=4, labels={"nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy":
                                          "time-slicing"},
                  allocatable={"nvidia.com/gpu.shared": "4", "nvidia.com/gpu": "2", "cpu": "8", "memory": "8Gi"})
    spec = node_spec(partly, kube_cfg)
    assert spec.gpus == 4 and spec.sharing is not None and spec.sharing.shared_gpus == 2
    # the strategy none (or one replica) is not sharing
    for labels in ({"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "none"},
                   {"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "time-slicing"}):
        plain = node_spec(node("plain", labels=labels), kube_cfg)
        assert plain.sharing is None and plain.gpus == 8
    with pytest.raises(ValueError, match=r"node bad: label nvidia\.com/gpu\.replicas='four' is not a whole number"):
        node_spec(node("bad", labels={"nvidia.com/gpu.replicas": "four"}), kube_cfg)
    with pytest.raises(ValueError, match=r"nvidia\.com/gpu\.sharing-strategy='vgpu' is none of"):
        node_spec(node("bad", labels={"nvidia.com/gpu.replicas": "2", "nvidia.com/gpu.sharing-strategy": "vgpu"}),
                  kube_cfg)


def test_mixed_mig_node_exposes_every_profile_and_its_whole_gpus(kube_cfg: KubernetesSource) -> None:
    # 8 GPUs: 2 partitioned 1g.10gb x7, 2 partitioned 3g.40gb x2 (one profile per GPU here), 4 not partitioned
    mixed = node("mixed", gpus=8, labels={"nvidia.com/mig.strategy": "mixed"},
                 allocatable={"nvidia.com/gpu": "4", "nvidia.com/mig-1g.10gb": "14", "nvidia.com/mig-3g.40gb": "4",
                              "nvidia.com/mig-2g.20gb": "0", "cpu": "64", "memory": "512Gi"})
    spec = node_spec(mixed, kube_cfg)
    assert spec.gpus == 4 and spec.mig is None  # the whole GPUs are used, not left idle
    assert spec.mig_profiles == {"1g.10gb": 14, "3g.40gb": 4}


def test_a_mixed_nodes_slices_held_by_others_are_not_offered(kube_cfg: KubernetesSource) -> None:
    from services.core.kube.usage import NodeLoads, pod_load
    from services.executor.kube.inventory import specs

    mixed = node("mixed", gpus=2, labels={"nvidia.com/mig.strategy": "mixed"},
                 allocatable={"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "7", "cpu": "64", "memory": "512Gi"})
    foreign = {"metadata": {"name": "infer", "namespace": "serving"}, "spec": {"nodeName": "mixed", "containers": [
        {"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}]}, "status": {"phase": "Running"}}
    loads = NodeLoads()
    loads.put("serving/infer", pod_load(foreign))
    assert specs([mixed], kube_cfg, loads)["mixed"].mig_profiles == {"1g.10gb": 5}


def test_replicas_other_pods_hold_on_a_shared_node_take_gpus_out(kube_cfg: KubernetesSource) -> None:
    from services.core.kube.usage import NodeLoads, pod_load
    from services.executor.kube.inventory import specs

    renamed = node("mps", gpus=2, labels={"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "mps"},
                   allocatable={"nvidia.com/gpu.shared": "8", "cpu": "64", "memory": "512Gi"})

    def foreign(name: str, replicas: int) -> dict[str, object]:
        return {"metadata": {"name": name, "namespace": "serving"}, "spec": {"nodeName": "mps", "containers": [
            {"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": str(replicas)}}}]},
            "status": {"phase": "Running"}}

    loads = NodeLoads()
    loads.put("serving/a", pod_load(foreign("a", 1)))
    assert specs([renamed], kube_cfg, loads)["mps"].held.gpus == 1  # the device plugin picks the GPU: one is out
    loads.put("serving/b", pod_load(foreign("b", 3)))
    assert specs([renamed], kube_cfg, loads)["mps"].held.gpus == 2  # never more than the node has
