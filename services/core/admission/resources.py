"""What a job asks of quota: per pod set, the quota resources it could be charged to, in preference order.

Quota unit (decision, docs/admission.md): whole GPUs per model; the resource name is the GPU model. A MIG pod
takes one slice of resource `"<model>:<profile>"` when the queue has a quota under that key; otherwise it is
charged one whole GPU of `<model>` (a conservative upper bound that never over-admits). Pod sets that ask for
no GPU take no quota and get no flavor.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.domain import JobSpec

# (gpu model, quota resource, amount)
GpuOption = tuple[str, str, int]
# one pod set's demand: (amount, acceptable models (empty = any), mig profile or None)
PodSetDemand = tuple[int, tuple[str, ...], str | None]
Signature = tuple[PodSetDemand, ...]


def mig_resource(model: str, profile: str) -> str:
    return f"{model}:{profile}"


def base_model(resource: str) -> str:
    return resource.split(":", 1)[0]


def request_signature(spec: JobSpec) -> Signature:
    """The part of a job that decides whether it fits: two jobs with equal signatures fit or fail together,
    which lets the cycle memoise fit checks across the many identical jobs of a deep queue."""
    return tuple(
        (ps.mig_slices if ps.mig_profile else ps.gpus, ps.gpu_models, ps.mig_profile)
        for ps in spec.pod_sets
        if ps.mig_profile or ps.gpus
    )


def gpu_pod_set_names(spec: JobSpec) -> tuple[str, ...]:
    """Names of the pod sets that appear in the signature, in the same order."""
    return tuple(ps.name for ps in spec.pod_sets if ps.mig_profile or ps.gpus)


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
            elif m in quotas:
                out.append((m, m, amount))
        elif m in quotas:
            out.append((m, m, amount))
    return tuple(out)
