"""Quota of a running elastic job (PodSet.min_count): charged for the pods it runs, not for its maximum.

Admission reserves an elastic pod set's floor (`resources._demand`); the pipeline charges each pod above it when it
starts or grows and gives the charge back when it shrinks (`charge_running`), on the flavor admission chose for the
pod set. `growth_room` is what one more job of the queue could take now (its nominal quota and what its cohort
lends, as for a borrowing job), only its nominal quota while a job of its cohort waits for admission, and nothing
while one of its own queue does: the pipeline gives back pods above a floor on the same terms, so a grown pod never
keeps a job out nor makes a reclaim preempt anyone.
"""

from __future__ import annotations

from dataclasses import replace

from shared.domain import JobSpec

from .model import AdmittedWorkload
from .resources import non_gpu_keys, resource_demands
from .state import AdmissionState


def above_floor(spec: JobSpec, flavors: dict[str, str], pods: int, keys: tuple[str, ...] = ()) -> dict[str, int]:
    """Quota resource -> what the pods above the floors take when the job runs `pods` pods: GPUs on each pod set's
    flavor, and of the queue's non-GPU quota keys `keys` (CPU, memory, pods, node pools) their part."""
    out: dict[str, int] = {}
    for ps, sized in zip(spec.pod_sets, spec.at_pods(pods).pod_sets, strict=True):
        model = flavors.get(ps.name)
        if ps.elastic and model is not None and sized.count > ps.floor:
            out[model] = out.get(model, 0) + (sized.count - ps.floor) * ps.gpus_per_pod
    if keys and pods > spec.min_pods:
        floor = {key: amount for amount, _, key in resource_demands(spec.at_pods(spec.min_pods), keys)}
        for amount, _, key in resource_demands(_fixed(spec, pods), keys):
            if key is not None and amount > floor.get(key, 0):
                out[key] = out.get(key, 0) + amount - floor.get(key, 0)
    return out


def _fixed(spec: JobSpec, pods: int) -> JobSpec:
    """The job with `pods` pods as a fixed job (JobSpec.at_pods keeps an elastic job whole at its most pods)."""
    sized = spec.at_pods(pods)
    if not sized.elastic:
        return sized
    return sized.model_copy(update={"pod_sets": tuple(p.model_copy(update={"min_count": None})
                                                      for p in sized.pod_sets)})


def quota_keys(state: AdmissionState, queue: str) -> tuple[str, ...]:
    """The non-GPU quota keys the queue sets (what a pod above a floor is charged besides its GPUs)."""
    qq = state.book.queues.get(queue)
    return non_gpu_keys(qq.nominal) if qq is not None else ()


def charge_running(state: AdmissionState, job_id: str, pods_before: int, pods: int) -> AdmittedWorkload | None:
    """The admitted elastic job now runs `pods` pods (it ran `pods_before`, its floor when it just started):
    its queue is charged for them. None when it is not admitted (nothing charged)."""
    a = state.admitted.get(job_id)
    if a is None or pods == pods_before:
        return a
    usage = dict(a.usage)
    keys = quota_keys(state, a.spec.queue)
    for n, sign in ((pods_before, -1), (pods, 1)):
        for r, amount in above_floor(a.spec, a.flavors, n, keys).items():
            usage[r] = usage.get(r, 0) + sign * amount
    charged = replace(a, usage={r: v for r, v in sorted(usage.items()) if v})
    state.restore_admitted(charged)
    return charged


def growth_room(state: AdmissionState, queue: str, model: str, memo: dict[str, bool]) -> int:
    """GPUs of `model` the queue's elastic jobs may still grow into: none while a job of the queue waits for
    admission; within its nominal quota while a job of its cohort does (the queue's own quota is its own; what its
    cohort lends is not while someone there waits); else what the quota book lets one more job of it take."""
    if queue_waits(state, queue, memo):
        return 0
    room = state.available(queue, model)
    if cohort_waits(state, queue, memo):
        room = min(room, -over_nominal(state, queue, model))
    return max(0, room)


def over_nominal(state: AdmissionState, queue: str, model: str) -> int:
    """GPUs of `model` the queue holds above its nominal quota (negative: what it has left of it)."""
    qq = state.book.queues.get(queue)
    return state.usage(queue).get(model, 0) - (qq.nominal.get(model, 0) if qq is not None else 0)


def queue_waits(state: AdmissionState, queue: str, memo: dict[str, bool]) -> bool:
    """Whether a job the configuration can admit waits for admission in the queue (`memo`: for one pass)."""
    key = f"own:{queue}"
    if key not in memo:
        count, inadmissible, _ = state.waiting(queue)
        memo[key] = count > inadmissible
    return memo[key]


def cohort_waits(state: AdmissionState, queue: str, memo: dict[str, bool]) -> bool:
    """Whether a job the configuration can admit waits for admission in the queue's cohort (the queue alone when it
    has none); `memo`: per cohort, for one pass."""
    qq = state.book.queues.get(queue)
    if qq is None:
        return True
    key = qq.cohort if qq.cohort is not None else f"queue:{queue}"
    if key not in memo:
        members = sorted(q for q, o in state.book.queues.items() if q == queue
                         or (qq.cohort is not None and o.cohort == qq.cohort))
        memo[key] = any(count > inadmissible for count, inadmissible, _ in map(state.waiting, members))
    return memo[key]


__all__ = [
    "above_floor",
    "charge_running",
    "cohort_waits",
    "growth_room",
    "over_nominal",
    "queue_waits",
    "quota_keys",
]
