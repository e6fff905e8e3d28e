"""How a placement takes and gives back resources on the index's nodes: a commit validates what it takes on
every node before it changes any (all or nothing), then takes it; a release gives it back; a node replaced by a
new spec takes again what its placements held. The index (`ClusterIndex`) owns the nodes passed here (cloned
before the first change) and moves their buckets afterwards."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.domain import MILLI_GPU, GpuBinding

from .nodes import IndexedNode, bits, held_at
from .types import Placement, PlacementConflict


@dataclass
class NodeNeed:
    """What one placement takes on one node (commit's validation phase)."""

    mask: int = 0
    slices: dict[int, int] = field(default_factory=dict)  # gpu -> slice mask
    cpu: int = 0
    mem: int = 0
    shares: dict[int, list[int]] = field(default_factory=dict)  # shared gpu -> [milli-GPUs, GPU memory MiB, pods]
    profs: dict[str, int] = field(default_factory=dict)  # mixed MIG: profile -> slice mask


def mixed_profile(n: IndexedNode, b: GpuBinding) -> str | None:
    """The profile a MIG binding names on a mixed-MIG node (`mig_slice` = (profile index, slice)), or None."""
    if n.prof_free is None or b.mig_slice is None:
        return None
    names = sorted(n.prof_free)
    return names[b.mig_slice[0]] if 0 <= b.mig_slice[0] < len(names) else None


def _shared_ok(n: IndexedNode, b: GpuBinding) -> bool:
    """Whether a binding on a shared GPU names one of the node's shared GPUs."""
    return n.sh_share is not None and b.shared_gpu is not None and b.shared_gpu < len(n.sh_share)


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
        if b.shared_gpu is not None:
            if not _shared_ok(n, b):
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} has no shared GPU {b.shared_gpu}")
            got = entry.shares.setdefault(b.shared_gpu, [0, 0, 0])
            got[0] += b.share_milli or 0
            got[1] += b.gpu_memory_mib or 0
            got[2] += 1
        elif b.mig_slice is not None and n.prof_free is not None:
            prof = mixed_profile(n, b)
            g, s = b.mig_slice
            if prof is None:
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} has no MIG profile #{g}")
            if not n.prof_free[prof] >> s & 1 or entry.profs.get(prof, 0) >> s & 1:
                raise PlacementConflict(f"job {placement.job_id}: {prof} slice {s} on {b.node} is taken")
            entry.profs[prof] = entry.profs.get(prof, 0) | (1 << s)
        elif b.mig_slice is not None:
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
        sharing = n.spec.sharing
        for g, (share, gmem, pods) in sorted(e.shares.items()):
            assert n.sh_share is not None and n.sh_mem is not None and n.sh_pods is not None and sharing is not None
            if (n.sh_share[g] + share > MILLI_GPU or n.sh_pods[g] + pods > sharing.replicas
                    or (gmem and (not sharing.gpu_memory_mib or n.sh_mem[g] + gmem > sharing.gpu_memory_mib))):
                raise PlacementConflict(f"job {placement.job_id}: shared GPU {g} of {name} lacks room (needs "
                                        f"{share} milli-GPUs, {gmem} MiB, {pods} pod(s); holds {n.sh_share[g]}, "
                                        f"{n.sh_mem[g]} MiB, {n.sh_pods[g]} pod(s))")
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
    for g, (share, gmem, pods) in e.shares.items():
        assert n.sh_share is not None and n.sh_mem is not None and n.sh_pods is not None
        n.sh_share[g] += share
        n.sh_mem[g] += gmem
        n.sh_pods[g] += pods
    if e.profs and n.prof_free is not None:
        for prof, smask in e.profs.items():
            n.units -= (smask & n.prof_free[prof]).bit_count()
            n.prof_free[prof] &= ~smask
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
        if b.shared_gpu is not None:
            if _shared_ok(node, b):  # on what the new spec still shares (a restored placement is kept as it was)
                assert node.sh_share is not None and node.sh_mem is not None and node.sh_pods is not None
                node.sh_share[b.shared_gpu] += b.share_milli or 0
                node.sh_mem[b.shared_gpu] += b.gpu_memory_mib or 0
                node.sh_pods[b.shared_gpu] += 1
        elif node.prof_free is not None and b.mig_slice is not None:
            prof = mixed_profile(node, b)
            s = b.mig_slice[1]
            if prof is not None and node.prof_free[prof] >> s & 1:
                node.prof_free[prof] &= ~(1 << s)
                node.units -= 1
        elif node.slice_free is not None and b.mig_slice is not None:
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
        if b.shared_gpu is not None:
            if _shared_ok(n, b):
                assert n.sh_share is not None and n.sh_mem is not None and n.sh_pods is not None
                g = b.shared_gpu
                n.sh_share[g] = max(0, n.sh_share[g] - (b.share_milli or 0))
                n.sh_mem[g] = max(0, n.sh_mem[g] - (b.gpu_memory_mib or 0))
                n.sh_pods[g] = max(0, n.sh_pods[g] - 1)
        elif b.mig_slice is not None and n.prof_free is not None:
            prof = mixed_profile(n, b)
            s = b.mig_slice[1]
            if prof is not None and s < n.spec.mig_profiles.get(prof, 0) and not n.prof_free[prof] >> s & 1:
                n.prof_free[prof] |= 1 << s
                n.units += 1
        elif b.mig_slice is not None and n.slice_free is not None:
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


__all__ = ["NodeNeed", "give_back", "mixed_profile", "needs_of", "retake", "take"]
