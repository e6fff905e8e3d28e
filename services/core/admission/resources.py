"""What a job asks of quota: per pod set, the quota resources it could be charged to, in preference order.

Quota unit (decision, docs/admission.md): whole GPUs per model; the resource name is the GPU model. A MIG pod
takes one slice of resource `"<model>:<profile>"` when the queue has a quota under that key; otherwise it is
charged one whole GPU of `<model>` (a conservative upper bound that never over-admits). A pod set sharing a GPU
(`gpu_fraction`) takes its milli-GPUs of `"<model>:gpu-share"` when the queue has that key, else the whole GPUs of
`<model>` its shares add up to, rounded up; one asking only GPU memory takes its MiB of `"<model>:gpu-memory"`
(no fallback: its share of a GPU depends on the node's GPU memory). Pod sets that ask for no GPU take no quota and
get no flavor.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.domain import MILLI_GPU, JobSpec, PodSet

# (gpu model, quota resource, amount)
GpuOption = tuple[str, str, int]
# one pod set's demand: (amount, acceptable models (empty = any), mig profile or None)
PodSetDemand = tuple[int, tuple[str, ...], str | None]
Signature = tuple[PodSetDemand, ...]


GPU_SHARE = "gpu-share"  # quota resource `<model>:gpu-share`: milli-GPUs of compute of shared GPUs
GPU_MEMORY = "gpu-memory"  # quota resource `<model>:gpu-memory`: MiB of GPU memory of shared GPUs
SHARED_RESOURCES = (GPU_SHARE, GPU_MEMORY)


def mig_resource(model: str, profile: str) -> str:
    return f"{model}:{profile}"


def shared_demand(ps: PodSet) -> tuple[int, str]:
    """(amount, resource suffix) a pod set sharing a GPU asks of quota: its milli-GPUs of gpu-share, or, asking only
    GPU memory, its MiB of gpu-memory."""
    if ps.gpu_fraction is not None:
        return ps.count * ps.share_milli, GPU_SHARE
    return ps.count * (ps.gpu_memory_mib or 0), GPU_MEMORY


def base_model(resource: str) -> str:
    return resource.split(":", 1)[0]


def request_signature(spec: JobSpec) -> Signature:
    """The part of a job that decides whether it fits: two jobs with equal signatures fit or fail together,
    which lets the cycle memoise fit checks across the many identical jobs of a deep queue."""
    return tuple(_demand(ps) for ps in spec.pod_sets if ps.mig_profile or ps.gpus or ps.shared)


def _demand(ps: PodSet) -> PodSetDemand:
    if ps.mig_profile:
        return ps.mig_slices, ps.gpu_models, ps.mig_profile
    if ps.shared:
        amount, resource = shared_demand(ps)
        return amount, ps.gpu_models, resource
    return ps.gpus, ps.gpu_models, None


def gpu_pod_set_names(spec: JobSpec) -> tuple[str, ...]:
    """Names of the pod sets that appear in the signature, in the same order."""
    return tuple(ps.name for ps in spec.pod_sets if ps.mig_profile or ps.gpus or ps.shared)


def quota_models(quotas: Mapping[str, object]) -> tuple[str, ...]:
    """Base GPU models a queue has quota for, in the configuration's order (the platform team's preference)."""
    out: list[str] = []
    for key in quotas:
        m = base_model(key)
        if m not in out:
            out.append(m)
    return tuple(out)


def pod_set_options(demand: PodSetDemand, quotas: Mapping[str, object],
                    models_in_quota: tuple[str, ...]) -> tuple[GpuOption, ...]:
    """Flavors a pod set may take in this queue, in the job's any-of order (or the queue's order for 'any')."""
    amount, models, profile = demand
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
