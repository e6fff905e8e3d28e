"""Fragmentation: free GPUs that no waiting gang can use.

A free GPU counts as usable when at least one waiting gang (1) fits the whole cluster's free GPUs as it
stands — each pod set finds enough nodes of an acceptable model, healthy, whose taints it tolerates,
with `gpus_per_pod` free GPUs per pod — and (2) could put a pod on that GPU's node: a node with `free`
GPUs offers `floor(free / gpus_per_pod) * gpus_per_pod` of them to that pod set. Everything else that is
free is fragmented. With no waiting GPU job the answer is 0: idle capacity is not fragmentation (it shows
as `gpuq_gpus_free`). MIG pod sets are left out (slices are not whole GPUs). Topology is not considered:
this is a lower bound on fragmentation, cheap enough to compute at every scrape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shared.domain import JobSpec, NodeHealth, NodeSpec, TaintEffect

_BLOCKING = (TaintEffect.NO_SCHEDULE, TaintEffect.NO_EXECUTE)


def _tolerated(spec: JobSpec, node: NodeSpec) -> bool:
    return all(any(t.tolerates(taint) for t in spec.tolerations)
               for taint in node.taints if taint.effect in _BLOCKING)


def _shape(spec: JobSpec) -> tuple:
    """Jobs with the same shape fit the same nodes: evaluate each shape once."""
    return (tuple((p.count, p.gpus_per_pod, tuple(sorted(p.gpu_models))) for p in spec.pod_sets
                  if p.mig_profile is None and p.gpus_per_pod > 0),
            tuple(sorted((t.key, t.operator, t.value, str(t.effect)) for t in spec.tolerations)))


def usable_gpus(nodes: Iterable[NodeSpec], free: Mapping[str, int], waiting: Iterable[JobSpec]) -> dict[str, int]:
    """Per node name: how many of its free GPUs some waiting gang could use."""
    ready = sorted((n for n in nodes if n.health is NodeHealth.READY and free.get(n.name, 0) > 0),
                   key=lambda n: n.name)
    usable: dict[str, int] = {n.name: 0 for n in ready}
    shapes: dict[tuple, JobSpec] = {}
    for spec in sorted(waiting, key=lambda s: s.job_id):
        shape = _shape(spec)
        if shape[0] and shape not in shapes:
            shapes[shape] = spec
    for shape in sorted(shapes):
        spec = shapes[shape]
        offers: dict[str, int] = {}
        fits = True
        for p in spec.pod_sets:
            if p.mig_profile is not None or p.gpus_per_pod == 0:
                continue
            pods_possible = 0
            for n in ready:
                if (p.gpu_models and n.gpu_model not in p.gpu_models) or not _tolerated(spec, n):
                    continue
                pods_here = free[n.name] // p.gpus_per_pod
                if pods_here:
                    pods_possible += pods_here
                    offers[n.name] = max(offers.get(n.name, 0), pods_here * p.gpus_per_pod)
            if pods_possible < p.count:
                fits = False
                break
        if fits:
            for name, gpus in offers.items():
                usable[name] = max(usable[name], gpus)
    return usable


def fragmented_gpus(nodes: Iterable[NodeSpec], free: Mapping[str, int], waiting: Iterable[JobSpec]) -> dict[str, int]:
    """Per ready node with free GPUs: free GPUs no waiting gang can use (all 0 when nothing waits)."""
    nodes = list(nodes)
    waiting = [s for s in waiting if _shape(s)[0]]
    ready = [n for n in nodes if n.health is NodeHealth.READY and free.get(n.name, 0) > 0]
    if not waiting:
        return {n.name: 0 for n in ready}
    usable = usable_gpus(ready, free, waiting)
    return {n.name: free[n.name] - usable.get(n.name, 0) for n in ready}
