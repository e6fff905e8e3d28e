"""What a job asks of quota: per pod set, the quota resources it could be charged to, in preference order.

Quota unit (decision, docs/admission.md): whole GPUs per model; the resource name is the GPU model. A MIG pod
takes one slice of resource `"<model>:<profile>"` when the queue has a quota under that key; otherwise it is
charged one whole GPU of `<model>` (a conservative upper bound that never over-admits). A pod set sharing a GPU
(`gpu_fraction`) takes its milli-GPUs of `"<model>:gpu-share"` when the queue has that key, else the whole GPUs of
`<model>` its shares add up to, rounded up; one asking only GPU memory takes its MiB of `"<model>:gpu-memory"`
(no fallback: its share of a GPU depends on the node's GPU memory). Pod sets that ask for no GPU take no GPU quota and
get no flavor.

Quotas beyond GPUs (docs/admission.md "Quotas beyond GPUs"): a queue may also set `cpu_milli`, `memory_mib`, `pods`
and `pool/<name>` (GPUs of pod sets selecting node pool `<name>`). Only a queue that sets such a key charges it:
the job's signature then ends with one demand per key (`resource_demands`), whose single option is that key, so the
same borrowing arithmetic applies. A queue that sets none has the signature it always had.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.domain import MILLI_GPU, JobSpec, PodSet
from shared.quota_keys import CPU, MEMORY, PODS, POOL, POOL_LABEL, is_non_gpu, is_whole_gpu

# (gpu model, quota resource, amount)
GpuOption = tuple[str, str, int]
# one pod set's demand: (amount, acceptable models (empty = any), mig profile or None)
PodSetDemand = tuple[int, tuple[str, ...], str | None]
Signature = tuple[PodSetDemand, ...]
PoolChoice = tuple[str, Signature, int]  # (node pool, the job's request on it, that request's id): node_pools.py


GPU_SHARE = "gpu-share"  # quota resource `<model>:gpu-share`: milli-GPUs of compute of shared GPUs
GPU_MEMORY = "gpu-memory"  # quota resource `<model>:gpu-memory`: MiB of GPU memory of shared GPUs
SHARED_RESOURCES = (GPU_SHARE, GPU_MEMORY)

def non_gpu_keys(quotas: Mapping[str, object]) -> tuple[str, ...]:
    """The non-GPU quota keys a queue sets, sorted: what its jobs are charged besides GPUs."""
    return tuple(sorted(k for k in quotas if is_non_gpu(k)))


def resource_demands(spec: JobSpec, keys: tuple[str, ...]) -> tuple[PodSetDemand, ...]:
    """One demand per non-GPU key (its amount, no model, the key as its 'profile'); keys the job asks nothing of
    are left out. A pod set asking no GPU still takes its CPU, memory and pods. An elastic pod set counts its floor
    (min_count): the pods above it are charged when they run (admission/elastic.py)."""
    out: list[PodSetDemand] = []
    for key in keys:
        if key == CPU:
            amount = sum(ps.floor * ps.cpu_milli for ps in spec.pod_sets)
        elif key == MEMORY:
            amount = sum(ps.floor * ps.memory_mib for ps in spec.pod_sets)
        elif key == PODS:
            amount = sum(ps.floor for ps in spec.pod_sets)
        else:  # a pod on a MIG slice or sharing a GPU counts one GPU of the pool (never under-counted)
            pool = key[len(POOL):]
            amount = sum((ps.floor * ps.gpus_per_pod if ps.elastic else ps.gpus)
                         or (ps.count if ps.mig_profile or ps.shared else 0)
                         for ps in spec.pod_sets if ps.selector.get(POOL_LABEL) == pool)
        if amount > 0:
            out.append((amount, (), key))
    return tuple(out)


def mig_resource(model: str, profile: str) -> str:
    return f"{model}:{profile}"


def shared_demand(ps: PodSet) -> tuple[int, str]:
    """(amount, resource suffix) a pod set sharing a GPU asks of quota: its milli-GPUs of gpu-share, or, asking only
    GPU memory, its MiB of gpu-memory."""
    if ps.gpu_fraction is not None:
        return ps.count * ps.share_milli, GPU_SHARE
    return ps.count * (ps.gpu_memory_mib or 0), GPU_MEMORY


def non_gpu_usage(spec: JobSpec, quotas: Mapping[str, object]) -> dict[str, int]:
    """What admission charges a job besides GPUs in a queue with these quotas: the preemption service counts it in a
    victim's usage, so that a reclaim of borrowed CPU or memory finds the jobs that hold it."""
    return {key: amount for amount, _m, key in resource_demands(spec, non_gpu_keys(quotas)) if key is not None}


def gpu_capped(cap: Mapping[str, int], resource: str) -> bool:
    """Whether free physical capacity (`capacity`: GPUs per model, and slices where given) bounds a resource."""
    return resource in cap or is_whole_gpu(resource)


def base_model(resource: str) -> str:
    return resource.split(":", 1)[0]


def request_signature(spec: JobSpec, non_gpu: tuple[str, ...] = ()) -> Signature:
    """The part of a job that decides whether it fits: two jobs with equal signatures fit or fail together,
    which lets the cycle memoise fit checks across the many identical jobs of a deep queue. `non_gpu`: the
    queue's non-GPU quota keys (`non_gpu_keys`), whose demands end the signature."""
    sig = tuple(_demand(ps) for ps in spec.pod_sets if ps.mig_profile or ps.gpus or ps.shared)
    return sig + resource_demands(spec, non_gpu) if non_gpu else sig


def _demand(ps: PodSet) -> PodSetDemand:
    if ps.mig_profile:
        return ps.mig_slices, ps.gpu_models, ps.mig_profile
    if ps.shared:
        amount, resource = shared_demand(ps)
        return amount, ps.gpu_models, resource
    # an elastic pod set is admitted for its floor (min_count): quota charges what runs, the pods above it are
    # charged when they start (admission/elastic.py)
    return ps.floor * ps.gpus_per_pod, ps.gpu_models, None


def gpu_pod_set_names(spec: JobSpec) -> tuple[str, ...]:
    """Names of the pod sets that appear in the signature, in the same order."""
    return tuple(ps.name for ps in spec.pod_sets if ps.mig_profile or ps.gpus or ps.shared)


def quota_models(quotas: Mapping[str, object]) -> tuple[str, ...]:
    """Base GPU models a queue has quota for, in the configuration's order (the platform team's preference)."""
    out: list[str] = []
    for key in quotas:
        m = base_model(key)
        if m not in out and not is_non_gpu(key):
            out.append(m)
    return tuple(out)


def pod_set_options(demand: PodSetDemand, quotas: Mapping[str, object],
                    models_in_quota: tuple[str, ...]) -> tuple[GpuOption, ...]:
    """Flavors a pod set may take in this queue, in the job's any-of order (or the queue's order for 'any')."""
    amount, models, profile = demand
    if profile is not None and is_non_gpu(profile):
        return (("", profile, amount),) if profile in quotas else ()
    out: list[GpuOption] = []
    for m in models or models_in_quota:
        if profile is not None:
            key = mig_resource(m, profile)
            if key in quotas:
                out.append((m, key, amount))
            elif profile == GPU_SHARE and m in quotas:
                out.append((m, m, -(-amount // MILLI_GPU)))  # the whole GPUs its shares add up to
            elif profile != GPU_MEMORY and m in quotas:
                out.append((m, m, amount))
        elif m in quotas:
            out.append((m, m, amount))
    return tuple(out)


def pins_pool(spec: JobSpec) -> bool:
    """Whether the job chooses its node pool itself: one of its pod sets selects the nodes' `pool` label."""
    return any(POOL_LABEL in ps.selector for ps in spec.pod_sets)


def with_pool(spec: JobSpec, pool: str) -> JobSpec:
    """The job as admitted on node pool `pool` (docs/admission.md, "Node pools as flavors"): each pod set selects
    nodes labelled `pool: <pool>`, so its GPUs are charged to `pool/<pool>` and the scheduler places it there."""
    return spec.model_copy(update={"pod_sets": tuple(
        ps if POOL_LABEL in ps.selector else ps.model_copy(update={"node_selector": {**ps.node_selector,
                                                                                  POOL_LABEL: pool}})
        for ps in spec.pod_sets)})


def pool_signatures(spec: JobSpec, pools: tuple[str, ...] | None,
                    non_gpu: tuple[str, ...]) -> tuple[tuple[str, Signature], ...]:
    """The node pools admission may choose for a job, in its queue's order, each with the job's signature on it;
    () when the queue lists no pools or the job selects one itself."""
    if not pools or pins_pool(spec):
        return ()
    return tuple((pool, request_signature(with_pool(spec, pool), non_gpu)) for pool in pools)
