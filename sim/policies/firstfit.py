"""First-fit pod placement for the baselines: what the default Kubernetes scheduler effectively does for
GPU pods when nothing else is configured (each pod on the first node that has room, no gang, no topology).

Nodes are kept in pools by (GPU model, whole GPUs | MIG slices) in name order; each pool is a max segment
tree over free units so "the first node with >= k free" costs O(log n), not a scan of every node.
CPU and memory are not checked (the baselines are given the benefit of the doubt).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.domain import NodeSpec


def _slices_per_gpu(node: NodeSpec) -> int:
    """Units per GPU of a pool's nodes: slices on a MIG pool, 1 on a whole-GPU pool."""
    return node.mig.slices_per_gpu if node.mig is not None else 1


class _MaxTree:
    def __init__(self, values: Sequence[int]):
        size = 1
        while size < max(1, len(values)):
            size *= 2
        self.size = size
        self.t = [0] * (2 * size)
        self.t[size:size + len(values)] = list(values)
        for i in range(size - 1, 0, -1):
            self.t[i] = max(self.t[2 * i], self.t[2 * i + 1])

    def max(self) -> int:
        return self.t[1]

    def first_at_least(self, k: int) -> int:
        """Index of the first leaf with value >= k, or -1."""
        if self.t[1] < k:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if self.t[2 * i] >= k else 2 * i + 1
        return i - self.size

    def add(self, idx: int, delta: int) -> None:
        i = idx + self.size
        self.t[i] += delta
        i //= 2
        while i:
            self.t[i] = max(self.t[2 * i], self.t[2 * i + 1])
            i //= 2


class FirstFit:
    def __init__(self, nodes: Sequence[NodeSpec]):
        ready = sorted((n for n in nodes if n.health == "ready" and n.gpus > 0), key=lambda n: n.name)
        pools: dict[tuple[str, bool], list[NodeSpec]] = {}
        for n in ready:
            pools.setdefault((n.gpu_model, n.mig is not None), []).append(n)
        self.keys = sorted(pools)
        self.names = {k: [n.name for n in pools[k]] for k in self.keys}
        self.capacity = {k: [n.gpus * (n.mig.slices_per_gpu if n.mig else 1) for n in pools[k]]
                         for k in self.keys}
        self.trees = {k: _MaxTree(self.capacity[k]) for k in self.keys}
        self.slice_milli = {k: 1000 // _slices_per_gpu(pools[k][0]) for k in self.keys}

    def pools_for(self, models: Sequence[str], slices: bool) -> list[tuple[str, bool]]:
        return [k for k in self.keys if k[1] == slices and (not models or k[0] in models)]

    def place_pod(self, models: Sequence[str], slices: bool, units: int) -> tuple[tuple[str, bool], int] | None:
        """First node, in name order across the acceptable pools, with `units` free: (pool, node index)."""
        best: tuple[str, tuple[str, bool], int] | None = None
        for k in self.pools_for(models, slices):
            idx = self.trees[k].first_at_least(units)
            if idx >= 0:
                name = self.names[k][idx]
                if best is None or name < best[0]:
                    best = (name, k, idx)
        if best is None:
            return None
        self.trees[best[1]].add(best[2], -units)
        return best[1], best[2]

    def free(self, pool: tuple[str, bool], idx: int, units: int) -> None:
        self.trees[pool].add(idx, units)

    def max_free(self, models: Sequence[str], slices: bool) -> int:
        return max((self.trees[k].max() for k in self.pools_for(models, slices)), default=0)

    def free_units(self) -> list[tuple[tuple[str, bool], int]]:
        """(pool, free units) for every node with something free, in pool and name order."""
        out = []
        for k in self.keys:
            tree = self.trees[k]
            for i in range(len(self.names[k])):
                v = tree.t[tree.size + i]
                if v:
                    out.append((k, v))
        return out
