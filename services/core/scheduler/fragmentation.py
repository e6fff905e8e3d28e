"""Fragmentation: free whole GPUs that none of the waiting gangs could use. The one definition: telemetry's
`gpuq_gpus_fragmented` gauge and the simulator's fragmentation samples both call `fragmented_gpus`.

A waiting gang is a job with at least one pod set of whole GPUs (MIG-only and CPU-only jobs are not: slices
are cut on purpose, and CPU pods strand no GPU). With no waiting gang nothing is fragmented: idle capacity
is not fragmentation (it shows as free GPUs).

A free whole GPU counts as usable when some waiting gang (a) can be placed now and (b) has a pod set whose
pods fit on that GPU's node: the node is eligible (model, taints, health), the GPUs counted are whole
multiples of the pod's GPUs (5 free GPUs and 4-GPU pods leave 1 stranded), CPU and memory allow the pods,
and, for `required_level`, the node's domain has enough free GPUs for the whole gang.
MIG-partitioned capacity is not counted (it is sliced on purpose), nor are shared GPUs (NodeSpec.sharing).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.domain import JobSpec, TopologyLevel

from .index import ClusterIndex
from .placer import try_place
from .staging import Stage, domain_free, placement_shape, prepare, resolve
from .types import Unplaceable


def _is_gang(spec: JobSpec) -> bool:
    return any(ps.gpus > 0 for ps in spec.pod_sets)  # whole GPUs (not MIG slices, not a share of a GPU)


def fragmented_gpus(state: ClusterIndex, waiting: Sequence[JobSpec]) -> dict[str, int]:
    """Per READY plain node with free whole GPUs: how many of them no waiting gang can use."""
    state.refresh_index()
    free = {name: n.free_whole_gpus for name, n in sorted(state.indexed_nodes.items())
            if n.ready and n.slice_free is None and n.free_whole_gpus > 0}
    gangs = [s for s in waiting if _is_gang(s)]
    if not gangs:
        return dict.fromkeys(free, 0)
    usable: dict[str, int] = {}
    seen: set[tuple[object, ...]] = set()
    stage = Stage(state, None)
    nodes, order, classes = state.indexed_nodes, state.rank_order, state.classes
    for spec in gangs:
        shape = placement_shape(spec)  # all that is read of the spec below
        if shape in seen:
            continue  # the same shape answers the same way
        seen.add(shape)
        reqs = resolve(spec, ())
        if isinstance(reqs, Unplaceable) or try_place(state, spec, reqs) is None:
            continue  # it cannot be placed now (the placement, without the diagnosis of why not)
        job = prepare(state, spec, reqs)
        level = spec.topology.required_level
        domains_ok: dict[str, int] | None = None
        if level is not None and level is not TopologyLevel.NODE:
            domains_ok = domain_free(state, job.union, level)
        for req, elig in zip(job.reqs, job.eligs, strict=True):
            if not req.gpus:
                continue
            for _, key in elig:
                for b, ranks in classes[key].buckets.items():
                    if b < req.gpus or (level is TopologyLevel.NODE and b < job.need):
                        continue
                    for r in ranks:
                        name = order[r]
                        if domains_ok is not None and level is not None and \
                                domains_ok.get(nodes[name].domain(level), 0) < job.need:
                            continue
                        use = stage.fits(name, req) * req.gpus
                        if use > usable.get(name, 0):
                            usable[name] = use
    return {name: f - usable.get(name, 0) for name, f in free.items()}


def fragmentation(state: ClusterIndex, waiting: Sequence[JobSpec]) -> int:
    """Free whole GPUs no waiting gang can use, in all (`fragmented_gpus` summed)."""
    return sum(fragmented_gpus(state, waiting).values())


__all__ = ["fragmentation", "fragmented_gpus"]
