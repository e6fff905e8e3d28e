"""How a placement takes and gives back resources on the index's nodes: a commit validates what it takes on
every node before it changes any (all or nothing), then takes it; a release gives it back; a node replaced by a
new spec takes again what its placements held. The index (`ClusterIndex`) owns the nodes passed here (cloned
before the first change) and moves their buckets afterwards."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .nodes import IndexedNode, bits, held_at
from .types import Placement, PlacementConflict


@dataclass
class NodeNeed:
    """What one placement takes on one node (commit's validation phase)."""

    mask: int = 0
    slices: dict[int, int] = field(default_factory=dict)  # gpu -> slice mask
    cpu: int = 0
    mem: int = 0


def needs_of(placement: Placement, nodes: Mapping[str, IndexedNode]) -> dict[str, NodeNeed]:
    """What the placement takes per node, validated against the nodes' current free state (commit's first phase:
    changes nothing). Raises PlacementConflict naming what is missing or taken."""
    need: dict[str, NodeNeed] = {}
    for i, b in enumerate(placement.bindings):
        n = nodes.get(b.node)
        if n is None:
            raise PlacementConflict(f"job {placement.job_id}: node {b.node} does not exist")
        if not n.ready:
            raise PlacementConflict(f"job {placement.job_id}: node {b.node} is {n.spec.health.value}")
        entry = need.setdefault(b.node, NodeNeed())
        if b.mig_slice is not None:
            g, s = b.mig_slice
            if n.slice_free is None or g >= n.gpus or s >= n.slices_per_gpu:
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} has no MIG slice {g}/{s}")
            if entry.slices.get(g, 0) >> s & 1:
                raise PlacementConflict(f"job {placement.job_id}: MIG slice {g}/{s} on {b.node} bound twice")
            entry.slices[g] = entry.slices.get(g, 0) | (1 << s)
        for g in b.gpu_indices:
            if n.slice_free is not None or g >= n.gpus:
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} has no whole GPU {g}")
            if entry.mask >> g & 1:
                raise PlacementConflict(f"job {placement.job_id}: GPU {g} on {b.node} bound twice")
            entry.mask |= 1 << g
        if placement.requests:
            entry.cpu += placement.requests[i][0]
            entry.mem += placement.requests[i][1]
    # What gpuq's own placements hold is taken; what pods outside gpuq hold gives way (see IndexedNode.held_want):
    # a placement the scheduler decides never uses it, only one restored or decided before they came.
    for name, e in need.items():
        n = nodes[name]
        usable = n.free_mask | n.held_mask
        if e.mask & ~usable:
            raise PlacementConflict(f"job {placement.job_id}: GPUs {bits(e.mask & ~usable)} on {name} "
                                    "are taken")
        for g, smask in e.slices.items():
            if n.slice_free is None or smask & ~(n.slice_free[g] | held_at(n, g)):
                raise PlacementConflict(f"job {placement.job_id}: MIG slices on GPU {g} of {name} are taken")
        cpu, mem = n.cpu + n.spec.held.cpu_milli, n.mem + n.spec.held.memory_mib
        if e.cpu > cpu or e.mem > mem:
            raise PlacementConflict(f"job {placement.job_id}: {name} lacks CPU/memory "
                                    f"(needs {e.cpu}m/{e.mem}MiB, free {n.cpu}m/{n.mem}MiB)")
    return need


def take(n: IndexedNode, e: NodeNeed, job_id: str) -> None:
    """Take what `needs_of` validated on one node (commit's second phase)."""
    took_held = bool(e.mask & n.held_mask)
    if e.mask:
        n.units -= (e.mask & n.free_mask).bit_count()
        n.free_mask &= ~e.mask
        n.held_mask &= ~e.mask
    if n.slice_free is not None:
        for g, smask in e.slices.items():
            held = held_at(n, g)
            if smask & held and n.held_slices is not None:
                n.held_slices[g] &= ~smask
                took_held = True
            n.units -= (smask & n.slice_free[g]).bit_count()
            n.slice_free[g] &= ~smask
    if took_held:
        n.rehold()
    n.cpu -= e.cpu
    n.mem -= e.mem
    n.jobs.add(job_id)


def retake(node: IndexedNode, placement: Placement) -> None:
    """Take again, on a node rebuilt from a new spec, what the placement holds there: what no longer exists on
    the new spec (a GPU or slice past its end) is not taken."""
    took_held = False
    for i, b in enumerate(placement.bindings):
        if b.node != node.name:
            continue
        cpu, mem = placement.requests[i] if placement.requests else (0, 0)
        if node.slice_free is not None and b.mig_slice is not None:
            g, s = b.mig_slice
            if g < node.gpus and s < node.slices_per_gpu:
                if node.slice_free[g] >> s & 1:
                    node.slice_free[g] &= ~(1 << s)
                    node.units -= 1
                elif node.held_slices is not None and node.held_slices[g] >> s & 1:
                    node.held_slices[g] &= ~(1 << s)  # gpuq's placement first: the held slice moves
                    took_held = True
        elif node.slice_free is None:
            for g in b.gpu_indices:
                if g < node.gpus and node.free_mask >> g & 1:
                    node.free_mask &= ~(1 << g)
                    node.units -= 1
                elif g < node.gpus and node.held_mask >> g & 1:
                    node.held_mask &= ~(1 << g)  # gpuq's placement first: the held GPU moves
                    took_held = True
        node.cpu -= cpu
        node.mem -= mem
        node.jobs.add(placement.job_id)
    if took_held:
        node.rehold()


def give_back(n: IndexedNode, placement: Placement, indices: list[int]) -> None:
    """Free the placement's bindings `indices` on node `n` (all of them on that node)."""
    for i in indices:
        b = placement.bindings[i]
        if b.mig_slice is not None and n.slice_free is not None:
            g, s = b.mig_slice
            if g < n.gpus and s < n.slices_per_gpu and not (n.slice_free[g] | held_at(n, g)) >> s & 1:
                n.slice_free[g] |= 1 << s
                n.units += 1
        elif n.slice_free is None:
            for g in b.gpu_indices:
                if g < n.gpus and not (n.free_mask | n.held_mask) >> g & 1:
                    n.free_mask |= 1 << g
                    n.units += 1
        if placement.requests:
            n.cpu += placement.requests[i][0]
            n.mem += placement.requests[i][1]
    n.jobs.discard(placement.job_id)
    if n.held_want and n.held_units < n.held_want:
        n.rehold()  # held units that had no room take what this release freed


__all__ = ["NodeNeed", "give_back", "needs_of", "retake", "take"]
