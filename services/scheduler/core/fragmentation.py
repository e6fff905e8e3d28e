"""Fragmentation: free GPUs that none of the waiting gangs could use.

A free whole GPU counts as usable when some waiting gang (a) can be placed now and (b) has a pod set whose
pods fit on that GPU's node: the node is eligible (model, taints, health), the GPUs counted are whole
multiples of the pod's GPUs (5 free GPUs and 4-GPU pods leave 1 stranded), CPU and memory allow the pods,
and, for `required_level`, the node's domain has enough free GPUs for the whole gang.
MIG-partitioned capacity is not counted (it is sliced on purpose).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.domain import JobSpec, TopologyLevel

from .placer import Stage, _prepare, domain_free, resolve
from .state import ClusterState
from .types import Placement, Unplaceable


def fragmentation(state: ClusterState, waiting: Sequence[JobSpec]) -> int:
    state._ensure_index()
    usable: dict[str, int] = {}
    seen: set[object] = set()
    stage = Stage(state, None)
    for spec in waiting:
        shape = (spec.model_dump_json(exclude={"job_id", "team", "queue", "labels", "user", "priority_class"}))
        if shape in seen:
            continue  # the same shape answers the same way
        seen.add(shape)
        if not isinstance(state.place(spec), Placement):
            continue
        reqs = resolve(spec, ())
        if isinstance(reqs, Unplaceable):
            continue
        job = _prepare(state, spec, reqs)
        level = spec.topology.required_level
        domains_ok: dict[str, int] | None = None
        if level is not None and level is not TopologyLevel.NODE:
            domains_ok = domain_free(state, job.union, level)
        for req, elig in zip(job.reqs, job.eligs, strict=True):
            if not req.gpus:
                continue
            for _, key in elig:
                c = state._classes[key]
                for b, ranks in c.buckets.items():
                    if b < req.gpus:
                        continue
                    for r in ranks:
                        name = state._order[r]
                        n = state._nodes[name]
                        if level is TopologyLevel.NODE and b < job.need:
                            continue
                        if domains_ok is not None and level is not None and \
                                domains_ok.get(n.domain(level), 0) < job.need:
                            continue
                        use = stage.fits(name, req) * req.gpus
                        if use > usable.get(name, 0):
                            usable[name] = use
    free = 0
    for n in state._nodes.values():
        if n.ready and n.slice_free is None:
            free += n.units
    return free - sum(usable.values())


__all__ = ["fragmentation"]
