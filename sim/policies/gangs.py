"""Whole-gang placement on the first-fit pools, for the baselines that place a job all at once (Slurm allocates a
job's nodes together; Volcano's gang plugin binds a gang only when every pod has a place)."""

from __future__ import annotations

from sim.policies.baselines import Pool, _Gang
from sim.policies.firstfit import FirstFit


def place_gang(ff: FirstFit, gang: _Gang, banned: frozenset[tuple[Pool, int]] = frozenset()) -> bool:
    """Place every pod of `gang` first fit, or none (what was taken is given back). `banned` nodes are not used
    (taken out of their trees for the attempt). On success the slots are in `gang.held`."""
    job = gang.job
    if ff.max_free(job.gpu_models, gang.slices) < gang.units:
        return False
    hidden: list[tuple[Pool, int, int]] = []
    for pool, idx in sorted(banned):
        tree = ff.trees[pool]
        free = tree.t[tree.size + idx]
        if free:
            tree.add(idx, -free)
            hidden.append((pool, idx, free))
    held: list[tuple[Pool, int]] = []
    try:
        for _ in range(job.pods):
            slot = ff.place_pod(job.gpu_models, gang.slices, gang.units)
            if slot is None:
                for pool, idx in held:
                    ff.free(pool, idx, gang.units)
                return False
            held.append(slot)
    finally:
        for pool, idx, free in hidden:
            ff.trees[pool].add(idx, free)
    gang.held = held
    gang.pods_left = 0
    return True
