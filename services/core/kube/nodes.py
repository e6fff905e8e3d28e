"""Node objects -> NodeSpec, following NVIDIA GPU Feature Discovery and the device plugin's mixed MIG strategy.

The node's labels are kept on the NodeSpec (jobs' nodeSelector and node affinity are matched against them), but
for those `ignored_labels` names: labels that change on every feature-discovery pass (GFD's timestamp) would make
each pass a NodeChanged. The pool label is also copied to `pool`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube.names import GPU_RESOURCE, MIG_RESOURCE_PREFIX
from services.core.kube.quantity import count, mebibytes, milli
from shared.config import KubernetesSource
from shared.domain import MigLayout, NodeHealth, NodeSpec, Taint, TaintEffect

CPU_ONLY_MODEL = "cpu"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
# Taints the node lifecycle controller sets for a node that is down: its pods are evicted, so the node is failed.
FAILURE_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable",
                            "node.kubernetes.io/out-of-service"})
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


def selected(node: Mapping[str, Any], cfg: KubernetesSource) -> bool:
    """Whether the node is gpuq's (cluster.yaml `node_selector`)."""
    labels = node.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in cfg.node_selector.items())


def health(node: Mapping[str, Any]) -> NodeHealth:
    """FAILED when not Ready or carrying a lifecycle NoExecute taint; CORDONED when unschedulable."""
    spec = node.get("spec") or {}
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = next((c.get("status") for c in conditions if c.get("type") == "Ready"), "Unknown")
    taints = spec.get("taints") or []
    if ready != "True" or any(t.get("key") in FAILURE_TAINTS and t.get("effect") == "NoExecute" for t in taints):
        return NodeHealth.FAILED
    if spec.get("unschedulable") or any(t.get("key") == UNSCHEDULABLE_TAINT for t in taints):
        return NodeHealth.CORDONED
    return NodeHealth.READY


def _domain(labels: Mapping[str, str], keys: tuple[str, ...], name: str) -> str:
    """A topology domain: the path of the levels' values. A node missing one of the labels is alone in its own
    domain (conservative: a job that needs one rack never spans nodes whose rack is unknown)."""
    values = [labels.get(k) for k in keys]
    if not keys or any(v is None for v in values):
        return f"~{name}"
    return "/".join(v for v in values if v is not None)


def _ignored(key: str, ignored: tuple[str, ...]) -> bool:
    return any(key.startswith(i[:-1]) if i.endswith("*") else key == i for i in ignored)


def node_spec(node: Mapping[str, Any], cfg: KubernetesSource) -> NodeSpec:
    """The NodeSpec of one Node object. Raises ValueError naming the field when a quantity is malformed."""
    meta = node.get("metadata") or {}
    name = meta["name"]
    labels: dict[str, str] = dict(meta.get("labels") or {})
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    allocatable: dict[str, Any] = dict((node.get("status") or {}).get("allocatable") or {})
    try:
        whole = count(allocatable.get(GPU_RESOURCE, 0))
        cpu = milli(allocatable.get("cpu", 0))
        memory = mebibytes(allocatable.get("memory", 0))
        migs = {k.removeprefix(MIG_RESOURCE_PREFIX): count(v) for k, v in allocatable.items()
                if k.startswith(MIG_RESOURCE_PREFIX)}
        physical = count(labels.get(GPU_COUNT_LABEL, whole))
    except ValueError as exc:
        raise ValueError(f"node {name}: {exc}") from None
    product = labels.get(cfg.gpu_product_label)
    model = cfg.gpu_flavors.get(product, product) if product else CPU_ONLY_MODEL
    gpus, mig = whole, None
    migs = {p: n for p, n in migs.items() if n > 0}
    if migs:
        # Mixed strategy: the partitioned GPUs expose slices; gpuq models one profile per node (the one with the
        # most slices, then by name). Whole GPUs left on a partly partitioned node are not used by gpuq.
        profile, slices = sorted(migs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        partitioned = max(1, physical - whole)
        gpus, mig = partitioned, MigLayout(profile=profile, slices_per_gpu=max(1, min(7, slices // partitioned)))
    raw_taints = sorted((node.get("spec") or {}).get("taints") or [], key=lambda t: (t["key"], t.get("effect", "")))
    taints = tuple(Taint(key=t["key"], value=t.get("value") or "", effect=TaintEffect(t.get("effect", "NoSchedule")))
                   for t in raw_taints if t["key"] not in FAILURE_TAINTS and t["key"] != UNSCHEDULABLE_TAINT)
    kept = {k: v for k, v in labels.items() if not _ignored(k, cfg.ignored_labels)}
    if cfg.pool_label and cfg.pool_label in labels:
        kept["pool"] = labels[cfg.pool_label]
    raw_datasets = labels.get(cfg.datasets_key) or annotations.get(cfg.datasets_key) or ""
    datasets = tuple(sorted({d.strip() for d in raw_datasets.replace(";", ",").split(",") if d.strip()}))
    levels = cfg.topology_levels
    return NodeSpec(name=name, gpus=gpus, gpu_model=model, cpu_milli=cpu, memory_mib=memory, mig=mig, labels=kept,
                    taints=taints, health=health(node), rack=_domain(labels, levels, name),
                    block=_domain(labels, levels[:-1], name) if len(levels) > 1 else "cluster", datasets=datasets)
