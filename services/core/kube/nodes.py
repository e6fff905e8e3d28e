"""Node objects -> NodeSpec, following NVIDIA GPU Feature Discovery (GFD) and the device plugin's sharing and MIG
strategies (docs/kubernetes.md, "Sharing GPUs").

- Whole GPUs: allocatable `nvidia.com/gpu`, the model from `nvidia.com/gpu.product` (cluster.yaml gpu_flavors).
- Time-slicing and MPS (the device plugin's `sharing` config): GFD labels `nvidia.com/gpu.replicas` (pods per GPU)
  and `nvidia.com/gpu.sharing-strategy` (`time-slicing`, `mps` or `none`; older GFD releases write no strategy, and
  `nvidia.com/mps.capable=true` then says MPS). The device plugin advertises each GPU `replicas` times, as
  `nvidia.com/gpu` or renamed `nvidia.com/gpu.shared`: such a node has allocatable / replicas GPUs, all shared
  (`NodeSpec.sharing`), never counted as whole GPUs. The product label then ends in `-SHARED` (not renamed), which is
  stripped before the flavor is looked up. `nvidia.com/gpu.memory` (MiB of one GPU) bounds GPU memory requests.
- MIG, mixed strategy (`nvidia.com/mig.strategy=mixed`): allocatable `nvidia.com/mig-<profile>` per profile beside
  `nvidia.com/gpu` for the GPUs not partitioned. A node all of whose GPUs are partitioned into one profile keeps the
  single-profile layout (`NodeSpec.mig`); a node with several profiles, or slices beside whole GPUs, is announced with
  its slices per profile (`NodeSpec.mig_profiles`) and its whole GPUs (`gpus`).

The node's labels are kept on the NodeSpec (jobs' nodeSelector and node affinity are matched against them), but
for those `ignored_labels` names: labels that change on every feature-discovery pass (GFD's timestamp) would make
each pass a NodeChanged. The pool label is also copied to `pool`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube.names import GPU_RESOURCE, MIG_RESOURCE_PREFIX, SHARED_GPU_RESOURCE, SPOT_TAINT
from services.core.kube.quantity import count, mebibytes, milli
from shared.config import KubernetesSource
from shared.domain import GpuSharing, MigLayout, NodeHealth, NodeSpec, SharingMode, Taint, TaintEffect

CPU_ONLY_MODEL = "cpu"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
# GPU Feature Discovery's sharing labels (NVIDIA/k8s-device-plugin, internal/lm and its README's label table).
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
SHARING_STRATEGY_LABEL = "nvidia.com/gpu.sharing-strategy"  # time-slicing | mps | none
MPS_CAPABLE_LABEL = "nvidia.com/mps.capable"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB of one GPU
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"  # none | single | mixed
SHARED_SUFFIX = "-SHARED"  # GFD's product label of a shared, not renamed, GPU
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
        gpus, sharing = _shared(labels, allocatable, whole)
    except ValueError as exc:
        raise ValueError(f"node {name}: {exc}") from None
    product = labels.get(cfg.gpu_product_label)
    if product and sharing is not None:
        product = product.removesuffix(SHARED_SUFFIX)
    model = cfg.gpu_flavors.get(product, product) if product else CPU_ONLY_MODEL
    mig, profiles = None, {}
    migs = {p: n for p, n in sorted(migs.items()) if n > 0}
    if migs and len(migs) == 1 and whole == 0 and sharing is None:
        # All its GPUs partitioned into one profile: the single-profile layout.
        profile, slices = next(iter(migs.items()))
        partitioned = max(1, physical - whole)
        gpus, mig = partitioned, MigLayout(profile=profile, slices_per_gpu=max(1, min(7, slices // partitioned)))
    elif migs:
        profiles = migs  # mixed: slices per profile beside the whole GPUs that are not partitioned
    raw_taints = sorted((node.get("spec") or {}).get("taints") or [], key=lambda t: (t["key"], t.get("effect", "")))
    taints = tuple(Taint(key=t["key"], value=t.get("value") or "", effect=TaintEffect(t.get("effect", "NoSchedule")))
                   for t in raw_taints if t["key"] not in FAILURE_TAINTS and t["key"] != UNSCHEDULABLE_TAINT)
    if cfg.spot_selector and all(labels.get(k) == v for k, v in cfg.spot_selector.items()):
        taints = (*taints, Taint(key=SPOT_TAINT, value="true", effect=TaintEffect.NO_SCHEDULE))
    kept = {k: v for k, v in labels.items() if not _ignored(k, cfg.ignored_labels)}
    if cfg.pool_label and cfg.pool_label in labels:
        kept["pool"] = labels[cfg.pool_label]
    raw_datasets = labels.get(cfg.datasets_key) or annotations.get(cfg.datasets_key) or ""
    datasets = tuple(sorted({d.strip() for d in raw_datasets.replace(";", ",").split(",") if d.strip()}))
    levels = cfg.topology_levels
    return NodeSpec(name=name, gpus=gpus, gpu_model=model, cpu_milli=cpu, memory_mib=memory, mig=mig, labels=kept,
                    taints=taints, health=health(node), rack=_domain(labels, levels, name),
                    block=_domain(labels, levels[:-1], name) if len(levels) > 1 else "cluster", datasets=datasets,
                    sharing=sharing, mig_profiles=profiles)


def _mode(labels: Mapping[str, str]) -> SharingMode | None:
    """The device plugin's sharing strategy as GFD labels it (None: not shared)."""
    strategy = (labels.get(SHARING_STRATEGY_LABEL) or "").strip().lower()
    if strategy == "none":
        return None
    if strategy:
        try:
            return SharingMode(strategy)
        except ValueError:
            raise ValueError(f"label {SHARING_STRATEGY_LABEL}={strategy!r} is none of time-slicing, mps, none"
                             ) from None
    # GFD before the strategy label: MPS when the MPS daemon's label says so, else time-slicing
    return SharingMode.MPS if labels.get(MPS_CAPABLE_LABEL) == "true" else SharingMode.TIME_SLICING


def _label_int(labels: Mapping[str, str], key: str) -> int:
    raw = labels.get(key)
    if raw is None or raw == "":
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"label {key}={raw!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"label {key}={raw!r} is negative")
    return value


def _shared(labels: Mapping[str, str], allocatable: Mapping[str, Any], whole: int) -> tuple[int, GpuSharing | None]:
    """(GPUs, sharing) of a node whose device plugin shares its GPUs; (whole, None) when it does not. A shared GPU
    is advertised `replicas` times: allocatable / replicas GPUs (rounded down), all of them shared, none whole."""
    replicas = _label_int(labels, REPLICAS_LABEL)
    mode = _mode(labels) if replicas > 1 else None
    if mode is None:
        return whole, None
    renamed = count(allocatable.get(SHARED_GPU_RESOURCE, 0))
    resource, advertised = (SHARED_GPU_RESOURCE, renamed) if renamed > 0 else (GPU_RESOURCE, whole)
    shared = advertised // replicas
    # Renamed, whole GPUs may be advertised beside the shared ones (a per-node config sharing only some).
    unshared = whole if resource == SHARED_GPU_RESOURCE else 0
    total = shared + unshared
    return total, GpuSharing(mode=mode, replicas=replicas, resource=resource,
                             gpu_memory_mib=_label_int(labels, GPU_MEMORY_LABEL),
                             shared_gpus=None if unshared == 0 else shared)
