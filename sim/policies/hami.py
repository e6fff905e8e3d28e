"""`volcano-hami`: Volcano's default configuration (sim/policies/volcano.py) with HAMi-like GPU sharing, the
Volcano/HAMi baseline of issue 47.

HAMi (the CNCF "heterogeneous AI computing virtualization middleware", Volcano's vGPU device plugin) lets every GPU
of every node take pods asking part of it (`nvidia.com/gpucores` / `gpumem`); a pod asking whole GPUs takes GPUs
nothing else uses. So, unlike gpuq (which shares only the GPUs of nodes configured to share, in one isolation
mode), the split between shared and whole GPUs is dynamic. Modelled per GPU: a fractional pod goes to the first
GPU, in node-name order, with its share free (first fit); a pod of k whole GPUs to the first node with k GPUs
entirely free; at most HAMi's default device split count (`SPLIT_COUNT`, 10) pods share one GPU. CPU and memory are
not checked (the baselines' benefit of the doubt). Node failures are not modelled for this policy. Replay it on a
trace loaded with fractions (`gpuq simulate --gpu-sharing time-slicing|mps`); MIG-slice pods count as whole GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.domain import NodeSpec
from sim.model import Trace, TraceJob
from sim.policies.baselines import _Gang
from sim.policies.firstfit import _MaxTree
from sim.policies.volcano import Volcano

SPLIT_COUNT = 10  # HAMi's deviceSplitCount default: pods per GPU at most
Pool = tuple[str, bool]


class SharedFit:
    """The FirstFit interface (sim/policies/firstfit.py) over milli-GPUs of single GPUs: `trees[pool]` is a max
    tree of each GPU's free milli-GPUs (node-name order, a node's GPUs adjacent), beside one of each node's GPUs
    entirely free. A slot is (pool, GPU index) for a fractional pod, (pool, -1 - node index) for whole GPUs."""

    def __init__(self, nodes: Sequence[NodeSpec]):
        ready = sorted((n for n in nodes if n.health == "ready" and n.gpus > 0), key=lambda n: n.name)
        pools: dict[Pool, list[NodeSpec]] = {}
        for n in ready:
            pools.setdefault((n.gpu_model, True), []).append(n)
        self.keys = sorted(pools)
        self.names = {k: [n.name for n in pools[k]] for k in self.keys}
        self.capacity = {k: [n.gpus * 1000 for n in pools[k]] for k in self.keys}
        self.slice_milli = dict.fromkeys(self.keys, 1)
        self.first_gpu: dict[Pool, list[int]] = {}
        self.node_of: dict[Pool, list[int]] = {}
        self.gpu_free: dict[Pool, list[int]] = {}
        self.pods: dict[Pool, list[int]] = {}
        self.trees: dict[Pool, _MaxTree] = {}
        self.whole: dict[Pool, _MaxTree] = {}  # per node: GPUs entirely free, × 1000
        self.held_whole: dict[tuple[Pool, int], list[int]] = {}  # node -> GPUs held whole there
        for k in self.keys:
            first: list[int] = []
            owner: list[int] = []
            for i, n in enumerate(pools[k]):
                first.append(len(owner))
                owner.extend([i] * n.gpus)
            self.first_gpu[k], self.node_of[k] = first, owner
            self.gpu_free[k] = [1000] * len(owner)
            self.pods[k] = [0] * len(owner)
            self.trees[k] = _MaxTree(self.gpu_free[k])
            self.whole[k] = _MaxTree(self.capacity[k])

    def pools_for(self, models: Sequence[str], slices: bool) -> list[Pool]:
        return [k for k in self.keys if not models or k[0] in models]

    def max_free(self, models: Sequence[str], slices: bool) -> int:
        return max((max(self.trees[k].max(), self.whole[k].max()) for k in self.pools_for(models, slices)),
                   default=0)

    def _set(self, k: Pool, g: int, free: int) -> None:
        before = self.gpu_free[k][g]
        self.gpu_free[k][g] = free
        room = free if self.pods[k][g] < SPLIT_COUNT else 0
        self.trees[k].add(g, room - self.trees[k].t[self.trees[k].size + g])
        node = self.node_of[k][g]
        self.whole[k].add(node, 1000 * ((free == 1000) - (before == 1000)))

    def place_pod(self, models: Sequence[str], slices: bool, units: int) -> tuple[Pool, int] | None:
        best: tuple[str, Pool, int] | None = None
        for k in self.pools_for(models, slices):
            if units < 1000:
                g = self.trees[k].first_at_least(units)
                if g >= 0 and (best is None or self.names[k][self.node_of[k][g]] < best[0]):
                    best = (self.names[k][self.node_of[k][g]], k, g)
            else:
                i = self.whole[k].first_at_least(units)
                if i >= 0 and (best is None or self.names[k][i] < best[0]):
                    best = (self.names[k][i], k, -1 - i)
        if best is None:
            return None
        _, k, idx = best
        if idx >= 0:
            self.pods[k][idx] += 1
            self._set(k, idx, self.gpu_free[k][idx] - units)
            return k, idx
        node = -1 - idx
        start = self.first_gpu[k][node]
        gpus = [g for g in range(start, start + self.capacity[k][node] // 1000) if self.gpu_free[k][g] == 1000]
        taken = gpus[:units // 1000]
        for g in taken:
            self._set(k, g, 0)
        self.held_whole.setdefault((k, node), []).extend(taken)
        return k, idx

    def free(self, pool: Pool, idx: int, units: int) -> None:
        if idx >= 0:
            self.pods[pool][idx] -= 1
            self._set(pool, idx, self.gpu_free[pool][idx] + units)
            return
        held = self.held_whole[(pool, -1 - idx)]
        for _ in range(units // 1000):
            self._set(pool, held.pop(), 1000)

    def free_units(self) -> list[tuple[Pool, int]]:
        return [(k, v) for k in self.keys for v in self.gpu_free[k] if v]


class VolcanoHami(Volcano):
    name = "volcano-hami"

    def setup(self, trace: Trace) -> None:
        super().setup(trace)
        self.ff = SharedFit(trace.nodes)  # type: ignore[assignment]  # the FirstFit interface, per GPU
        self.slot_of = {}

    def _gang(self, job: TraceJob) -> _Gang:
        units = job.share_milli if job.share_milli else job.gpus_per_pod * 1000
        return _Gang(job=job, slices=True, units=units, pods_left=job.pods)
