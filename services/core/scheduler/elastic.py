"""Resizing a running elastic job's placement (PodSet.min_count): one more pod where it fits, or fewer pods.

The placement keeps the pods it has (no pod moves): a grown job gets its next pod (`<pod set>-<next index>`) on
whatever node the placer would give one pod of that pod set now; a shrunk one gives back its highest-numbered pods
of its elastic pod sets, the last pod set first, never below a pod set's floor. Both are committed on the index.
Which jobs grow or shrink, and when, is the pipeline's (services/core/pipeline/elastic.py).
"""

from __future__ import annotations

from shared.domain import GpuBinding, JobSpec, PodSet

from .index import ClusterIndex
from .placer import place_job, resolve, try_place
from .types import Placement, Unplaceable


def pods_by_set(placement: Placement) -> dict[str, int]:
    """Pod set -> how many of its pods the placement holds."""
    counts: dict[str, int] = {}
    for b in placement.bindings:
        name = b.pod.rsplit("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def can_grow(spec: JobSpec, placement: Placement) -> PodSet | None:
    """The first elastic pod set below its count (the one its next pod joins), None at its size. A job asking for
    a required topology level does not grow: a pod placed alone could fall outside its domain."""
    if spec.topology.required_level is not None:
        return None
    have = pods_by_set(placement)
    for ps in spec.pod_sets:
        if ps.elastic and have.get(ps.name, 0) < ps.count:
            return ps
    return None


def grow_one(state: ClusterIndex, spec: JobSpec, allowed: tuple[str, ...], placement: Placement
             ) -> Placement | None:
    """The running job with one more pod (committed), or None (nothing changed) when no pod of it fits now."""
    ps = can_grow(spec, placement)
    if ps is None:
        return None
    one = spec.model_copy(update={"pod_sets": (ps.model_copy(update={"count": 1, "min_count": None}),)})
    reqs = resolve(one, allowed)
    if isinstance(reqs, Unplaceable):
        return None
    got = try_place(state, one, reqs)
    if got is None:
        return None
    taken = {b.pod for b in placement.bindings}
    index = next(i for i in range(ps.count + len(taken) + 1) if f"{ps.name}-{i}" not in taken)
    new = got.bindings[0].model_copy(update={"pod": f"{ps.name}-{index}"})
    requests = (*placement.requests, *got.requests) if placement.requests else ()
    return _recommit(state, placement, (*placement.bindings, new), requests)


def shrink_to(state: ClusterIndex, spec: JobSpec, placement: Placement, pods: int) -> Placement:
    """The running job with `pods` pods (at least its floors; committed): its highest-numbered pods of its elastic
    pod sets go first, the last pod set first."""
    have = pods_by_set(placement)
    drop = len(placement.bindings) - max(pods, spec.min_pods)
    gone: set[str] = set()
    for ps in reversed(spec.pod_sets):
        if drop <= 0:
            break
        if not ps.elastic:
            continue
        mine = sorted((b.pod for b in placement.bindings if b.pod.rsplit("-", 1)[0] == ps.name),
                      key=lambda pod: int(pod.rsplit("-", 1)[1]), reverse=True)
        n = min(drop, have.get(ps.name, 0) - ps.floor)
        gone.update(mine[:max(0, n)])
        drop -= max(0, n)
    if not gone:
        return placement
    keep = [i for i, b in enumerate(placement.bindings) if b.pod not in gone]
    requests = tuple(placement.requests[i] for i in keep) if placement.requests else ()
    return _recommit(state, placement, tuple(placement.bindings[i] for i in keep), requests)


def place_now(state: ClusterIndex, spec: JobSpec, allowed: tuple[str, ...]) -> Placement | None:
    """Where the job goes now (committed; an elastic one with what fits), or None (nothing changed)."""
    got = place_job(state, spec, allowed)
    if isinstance(got, Unplaceable):
        return None
    state.commit(got)
    return got


def restore(state: ClusterIndex, placement: Placement) -> None:
    """Put back a placement a shrink changed (the shrink was undone)."""
    state.release(placement.job_id)
    state.commit(placement)


def _recommit(state: ClusterIndex, old: Placement, bindings: tuple[GpuBinding, ...],
              requests: tuple[tuple[int, int], ...]) -> Placement:
    new = state.build_placement(old.job_id, bindings, requests)
    state.release(old.job_id)
    state.commit(new)
    return new


__all__ = ["can_grow", "grow_one", "place_now", "pods_by_set", "restore", "shrink_to"]
