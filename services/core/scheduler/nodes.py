"""The index's records: one node's free resources (`IndexedNode`) and one class of interchangeable nodes with
its buckets (`NodeClass`), plus the deterministic node order (`natural_key`). Read-only outside the index: the
index (`ClusterIndex`, in index.py) owns them and clones one before its first change (copy-on-write)."""

from __future__ import annotations

import re
from bisect import bisect_left, insort
from collections.abc import Mapping

from shared.domain import MILLI_GPU, NodeHealth, NodeSpec, SharingMode, Taint, TaintEffect, TopologyLevel

_HARD_EFFECTS = (TaintEffect.NO_SCHEDULE, TaintEffect.NO_EXECUTE)
_DIGITS = re.compile(r"(\d+)")

ClassKey = tuple[object, ...]  # (gpu model, MIG profile or "", taints[, (sharing mode or "", mixed MIG profiles)])


def natural_key(text: str) -> tuple[object, ...]:
    """'node-10' sorts after 'node-9' (split on digit runs; str and int parts alternate, so they compare)."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(_DIGITS.split(text)))


class CallableInt(int):
    """An int that can also be called: `state.free_gpus` and `state.free_gpus()` both work, so callers
    written against either spelling of the helper agree."""

    def __call__(self) -> int:
        return int(self)


class IndexedNode:
    """One node as the index sees it: its spec, its free resources and the jobs on it. Read-only outside
    this module (the `FreeResources` shape: `free_mask`, `slice_free`, `cpu`, `mem`)."""

    __slots__ = ("block", "cls", "cpu", "free_mask", "gpus", "held_mask", "held_slices", "held_want", "jobs", "mem",
                 "name", "owner", "prof_free", "rack", "rank", "ready", "sh_mem", "sh_pods", "sh_share", "slice_free",
                 "slices_per_gpu", "spec", "units")

    spec: NodeSpec
    name: str
    rank: int
    rack: str
    block: str
    cls: ClassKey
    ready: bool
    gpus: int
    slices_per_gpu: int  # 0 on a plain node
    free_mask: int  # bit i set = whole GPU i free (plain nodes only)
    slice_free: list[int] | None  # per GPU, bit s set = slice s free (MIG nodes only)
    units: int  # free whole GPUs, or free slices on a MIG node
    cpu: int
    mem: int
    jobs: set[str]
    owner: object
    # What pods gpuq does not manage hold (`NodeSpec.held`): `held_want` units, taken on the highest GPUs (slices)
    # gpuq's placements leave; they are neither free nor any job's. Which ones is gpuq's bookkeeping only (the
    # device plugin picks real devices), so a placement committed over them (one restored after a restart, made
    # before the pods came) takes them and the held units move to other free ones, or go short while none is free.
    held_want: int
    held_mask: int  # plain nodes: bit i set = GPU i held
    held_slices: list[int] | None  # MIG nodes: per GPU, bit s set = slice s held
    # Shared GPUs (NodeSpec.sharing: the node's first `spec.shared_gpus` GPUs): per shared GPU, the compute share
    # (milli-GPUs), the GPU memory (MiB) and the pods gpuq's placements hold there; None on a node without sharing.
    # Shared GPUs are never in `free_mask`: whole-GPU pods never use them, and `units` counts whole GPUs only.
    sh_share: list[int] | None
    sh_mem: list[int] | None
    sh_pods: list[int] | None
    # Mixed MIG (NodeSpec.mig_profiles): per profile, bit s set = its slice s free; None on other nodes. Those free
    # slices count in `units` beside the free whole GPUs (an upper bound either kind of pod may use).
    prof_free: dict[str, int] | None

    @classmethod
    def fresh(cls, spec: NodeSpec, owner: object) -> IndexedNode:
        n = cls()
        n.spec = spec
        n.name = spec.name
        n.rank = 0
        n.rack = spec.rack
        n.block = spec.block
        n.cls = class_key(spec)
        # Cordoned, failed and degraded (a GPU fault from the DCGM health checks) nodes take no new placements;
        # allocations already there are kept (see upsert_node) until their jobs end.
        n.ready = spec.health is NodeHealth.READY
        n.gpus = spec.gpus
        shared = spec.shared_gpus
        n.sh_share = [0] * shared if spec.sharing is not None else None
        n.sh_mem = [0] * shared if spec.sharing is not None else None
        n.sh_pods = [0] * shared if spec.sharing is not None else None
        n.prof_free = {p: (1 << k) - 1 for p, k in sorted(spec.mig_profiles.items())} if spec.mig_profiles else None
        if spec.mig is not None:
            n.slices_per_gpu = spec.mig.slices_per_gpu
            n.free_mask = 0
            n.slice_free = [(1 << spec.mig.slices_per_gpu) - 1] * spec.gpus
            n.units = spec.gpus * spec.mig.slices_per_gpu
        else:
            n.slices_per_gpu = 0
            n.free_mask = ((1 << spec.gpus) - 1) & ~((1 << shared) - 1)
            n.slice_free = None
            n.units = spec.gpus - shared + n.free_slices
        n.cpu = spec.cpu_milli - spec.held.cpu_milli
        n.mem = spec.memory_mib - spec.held.memory_mib
        n.jobs = set()
        n.owner = owner
        n.held_want = spec.held.mig_slices if spec.mig is not None else spec.held.gpus
        n.held_mask = 0
        n.held_slices = [0] * spec.gpus if spec.mig is not None else None
        if n.held_want:
            n.rehold()
        return n

    def clone(self, owner: object) -> IndexedNode:
        # every slot, written out (a loop of getattr/setattr over __slots__ cost twice as much, and a what-if
        # copy clones each node it releases on)
        n = IndexedNode()
        n.spec, n.name, n.rank, n.rack, n.block = self.spec, self.name, self.rank, self.rack, self.block
        n.cls = self.cls
        n.ready, n.gpus, n.slices_per_gpu, n.free_mask = self.ready, self.gpus, self.slices_per_gpu, self.free_mask
        n.slice_free = list(self.slice_free) if self.slice_free is not None else None
        n.units, n.cpu, n.mem = self.units, self.cpu, self.mem
        n.jobs = set(self.jobs)
        n.owner = owner
        n.held_want, n.held_mask = self.held_want, self.held_mask
        n.held_slices = list(self.held_slices) if self.held_slices is not None else None
        if self.sh_share is not None:
            n.sh_share, n.sh_mem, n.sh_pods = list(self.sh_share), list(self.sh_mem or ()), list(self.sh_pods or ())
        else:
            n.sh_share = n.sh_mem = n.sh_pods = None
        n.prof_free = dict(self.prof_free) if self.prof_free is not None else None
        return n

    @property
    def free_slices(self) -> int:
        """Free slices of a mixed-MIG node's profiles (0 on other nodes)."""
        return sum(m.bit_count() for m in self.prof_free.values()) if self.prof_free is not None else 0

    @property
    def held_units(self) -> int:
        """Units held outside gpuq now (at most `held_want`: fewer while gpuq's own placements leave no room)."""
        if self.held_slices is None:
            return self.held_mask.bit_count()
        return sum(h.bit_count() for h in self.held_slices)

    def rehold(self) -> None:
        """Place `held_want` held units on the highest GPUs (slices) gpuq's placements leave, and recount the free
        units: after the node is built, and after a placement took held units or a release freed room for
        units that were short."""
        want = self.held_want
        if self.slice_free is None:
            full = (1 << self.gpus) - 1
            avail = full & (self.free_mask | self.held_mask)  # everything no placement of gpuq holds
            held = 0
            while want and avail:
                top = 1 << (avail.bit_length() - 1)
                held |= top
                avail ^= top
                want -= 1
            self.held_mask, self.free_mask, self.units = held, avail, avail.bit_count() + self.free_slices
            return
        assert self.held_slices is not None
        units = 0
        for g in range(self.gpus - 1, -1, -1):
            avail = self.slice_free[g] | self.held_slices[g]
            held = 0
            while want and avail:
                top = 1 << (avail.bit_length() - 1)
                held |= top
                avail ^= top
                want -= 1
            self.held_slices[g], self.slice_free[g] = held, avail
            units += avail.bit_count()
        self.units = units

    @property
    def cap_units(self) -> int:
        if self.slices_per_gpu:
            return self.gpus * self.slices_per_gpu
        return self.gpus - self.spec.shared_gpus + sum(self.spec.mig_profiles.values())

    @property
    def free_whole_gpus(self) -> int:
        """Free whole GPUs; a partitioned GPU counts when all of its slices are free (shared GPUs never count)."""
        if self.slice_free is None:
            return self.units if self.prof_free is None else self.free_mask.bit_count()
        full = (1 << self.slices_per_gpu) - 1
        return sum(1 for s in self.slice_free if s == full)

    def domain(self, level: TopologyLevel) -> str:
        if level is TopologyLevel.NODE:
            return self.name
        return self.rack if level is TopologyLevel.RACK else self.block


def class_key(spec: NodeSpec) -> ClassKey:
    taints = tuple(sorted((t.key, t.value, t.effect.value) for t in spec.taints))
    if spec.sharing is None and not spec.mig_profiles:
        return (spec.gpu_model, spec.mig.profile if spec.mig else "", taints)
    mode = spec.sharing.mode.value if spec.sharing is not None else ""
    return (spec.gpu_model, spec.mig.profile if spec.mig else "", taints, (mode, tuple(sorted(spec.mig_profiles))))


def share_of(spec: NodeSpec, ps_share: int, gpu_memory_mib: int) -> int:
    """The compute share (milli-GPUs) one pod asking `ps_share` milli-GPUs (0: none) and `gpu_memory_mib` takes on
    a shared GPU of `spec`: its fraction, else its memory's part of the GPU (rounded up, at least 1); 0 when it
    cannot be told (memory only, on a node whose GPU memory is unknown)."""
    if ps_share:
        return ps_share
    cap = spec.sharing.gpu_memory_mib if spec.sharing is not None else 0
    if not cap or not gpu_memory_mib:
        return 0
    return max(1, min(MILLI_GPU, -(-gpu_memory_mib * MILLI_GPU // cap)))


def shared_room(spec: NodeSpec, share: int, gpu_memory_mib: int, used_share: int, used_mem: int, pods: int) -> int:
    """How many more pods of (`share` milli-GPUs, `gpu_memory_mib`) one shared GPU of `spec` holds with `used_share`,
    `used_mem` and `pods` already there: bounded by the compute left, the memory left (a memory request needs the
    GPU's memory known) and the device plugin's replicas."""
    sharing = spec.sharing
    if sharing is None or share <= 0:
        return 0
    k = min(sharing.replicas - pods, (MILLI_GPU - used_share) // share)
    if gpu_memory_mib:
        if not sharing.gpu_memory_mib:
            return 0
        k = min(k, (sharing.gpu_memory_mib - used_mem) // gpu_memory_mib)
    return max(k, 0)


class NodeClass:
    """Nodes interchangeable for eligibility: same model, MIG profile, taints, sharing mode and mixed-MIG profiles.
    Aggregates count READY nodes.
    Read-only outside this module."""

    __slots__ = ("buckets", "cap", "dom_buckets", "dom_free", "ds_buckets", "free", "hard", "key", "max_units",
                 "mig", "model", "owner", "profiles", "ready_nodes", "sharing", "soft", "total_nodes")

    def __init__(self, key: ClassKey, spec: NodeSpec, owner: object):
        self.key = key
        self.model = spec.gpu_model
        self.mig = spec.mig.profile if spec.mig else None
        self.sharing: SharingMode | None = spec.sharing.mode if spec.sharing is not None else None
        self.profiles: frozenset[str] = frozenset(spec.mig_profiles)  # mixed MIG: the profiles its nodes advertise
        self.hard: tuple[Taint, ...] = tuple(t for t in spec.taints if t.effect in _HARD_EFFECTS)
        self.soft: tuple[Taint, ...] = tuple(t for t in spec.taints if t.effect is TaintEffect.PREFER_NO_SCHEDULE)
        self.buckets: dict[int, list[int]] = {}
        # The same buckets restricted to the nodes caching each dataset: dataset preference without a scan.
        self.ds_buckets: dict[str, dict[int, list[int]]] = {}
        self.free = 0
        self.cap = 0
        self.max_units = 0
        self.ready_nodes = 0
        self.total_nodes = 0
        self.dom_free: dict[TopologyLevel, dict[str, int]] = {TopologyLevel.RACK: {}, TopologyLevel.BLOCK: {}}
        # Per level: free units -> sorted domain ranks, for best-fit domain search without a scan.
        self.dom_buckets: dict[TopologyLevel, dict[int, list[int]]] = {TopologyLevel.RACK: {},
                                                                        TopologyLevel.BLOCK: {}}
        self.owner = owner

    def clone(self, owner: object) -> NodeClass:
        c = NodeClass.__new__(NodeClass)
        for attr in NodeClass.__slots__:
            setattr(c, attr, getattr(self, attr))
        c.buckets = {k: list(v) for k, v in self.buckets.items()}
        c.ds_buckets = {d: {k: list(v) for k, v in b.items()} for d, b in self.ds_buckets.items()}
        c.dom_free = {lvl: dict(d) for lvl, d in self.dom_free.items()}
        c.dom_buckets = {lvl: {k: list(v) for k, v in b.items()} for lvl, b in self.dom_buckets.items()}
        c.owner = owner
        return c

    def move_node(self, node: IndexedNode, old_units: int,
                  dom_ranks: Mapping[TopologyLevel, Mapping[str, int]]) -> None:
        """Move a READY node of this class from the buckets of `old_units` free units to those of its units now,
        and its rack's and block's sums with it (an incremental update: the same as a rebuild computes)."""
        bucket = self.buckets[old_units]
        del bucket[bisect_left(bucket, node.rank)]
        if not bucket:
            del self.buckets[old_units]
        insort(self.buckets.setdefault(node.units, []), node.rank)
        for d in node.spec.datasets:
            by_units = self.ds_buckets[d]
            bucket = by_units[old_units]
            del bucket[bisect_left(bucket, node.rank)]
            if not bucket:
                del by_units[old_units]
            insort(by_units.setdefault(node.units, []), node.rank)
        delta = node.units - old_units
        self.free += delta
        for lvl, d in ((TopologyLevel.RACK, node.rack), (TopologyLevel.BLOCK, node.block)):
            frees = self.dom_free[lvl]
            before = frees[d]
            frees[d] = before + delta
            by_free = self.dom_buckets[lvl]
            rank = dom_ranks[lvl][d]
            bucket = by_free[before]
            del bucket[bisect_left(bucket, rank)]
            if not bucket:
                del by_free[before]
            insort(by_free.setdefault(before + delta, []), rank)


def held_at(n: IndexedNode, gpu: int) -> int:
    """The slices of a MIG node's GPU held outside gpuq (0 on a plain node or past its GPUs)."""
    return n.held_slices[gpu] if n.held_slices is not None and gpu < len(n.held_slices) else 0


def bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


__all__ = ["CallableInt", "ClassKey", "IndexedNode", "NodeClass", "bits", "class_key", "held_at", "natural_key",
           "share_of", "shared_room"]
