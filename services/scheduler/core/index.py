"""The cluster index the placement core decides on: nodes, their free GPUs/slices/CPU/memory, and indexes.

Indexes (so that a decision does not scan every node):
- nodes are grouped into *classes* (same GPU model, MIG profile and taints: the nodes a pod either can or
  cannot use as a whole); every class keeps `buckets[free_units] -> sorted node ranks` of its READY nodes,
  so best fit for a pod of g GPUs is "the first rank of the first non-empty bucket >= g";
- every class keeps free units per rack and per block (for topology best fit) and its total free units.

A *unit* is a whole GPU on a plain node and a MIG slice on a partitioned node.

Node *rank* orders nodes by (block, rack, name) with numbers compared as numbers: the deterministic
tie-break. Because nodes of a rack are adjacent in that order, equal-score choices fill racks one after
another, which keeps the remaining racks whole (rack-level binpack for free).

Copies are copy-on-write: `copy()` copies the name -> node and key -> class maps and gives both indexes a
new generation token; a node or class shared with another index is cloned before its first mutation.

Public read API (what the placer, the diagnosis, the reservation search and fragmentation use; nothing
outside this module reads a private field): `refresh_index()`, `indexed_nodes`, `classes`, `rank_order`,
`domain_members()`, `domain_ranks()`, `domain_order()`, `spec_memo()`, `holds()`, `placement_of()`, plus the
summaries (`allocations()`, `nodes()`, `free_on()`, `free_gpus`, ...). `IndexedNode` and `NodeClass` are the
read-only records those return: callers never write to them.
"""

from __future__ import annotations

import re
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from shared.domain import GpuBinding, JobSpec, NodeHealth, NodeSpec, Taint, TaintEffect, TopologyLevel

from .types import Placement, PlacementConflict

STRATEGIES = ("binpack", "spread")
_HARD_EFFECTS = (TaintEffect.NO_SCHEDULE, TaintEffect.NO_EXECUTE)
_DIGITS = re.compile(r"(\d+)")
_LEVELS = (TopologyLevel.RACK, TopologyLevel.BLOCK)

ClassKey = tuple[object, ...]  # (gpu model, MIG profile or "", taints)
T = TypeVar("T")
_I = TypeVar("_I", bound="ClusterIndex")
_MISSING = object()
MISSING = _MISSING  # what `state_memo` returns for an answer it does not hold


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
                 "name", "owner", "rack", "rank", "ready", "slice_free", "slices_per_gpu", "spec", "units")

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
        if spec.mig is not None:
            n.slices_per_gpu = spec.mig.slices_per_gpu
            n.free_mask = 0
            n.slice_free = [(1 << spec.mig.slices_per_gpu) - 1] * spec.gpus
            n.units = spec.gpus * spec.mig.slices_per_gpu
        else:
            n.slices_per_gpu = 0
            n.free_mask = (1 << spec.gpus) - 1
            n.slice_free = None
            n.units = spec.gpus
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
        return n

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
            self.held_mask, self.free_mask, self.units = held, avail, avail.bit_count()
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
        return self.gpus * self.slices_per_gpu if self.slices_per_gpu else self.gpus

    @property
    def free_whole_gpus(self) -> int:
        """Free whole GPUs; a partitioned GPU counts when all of its slices are free."""
        if self.slice_free is None:
            return self.units
        full = (1 << self.slices_per_gpu) - 1
        return sum(1 for s in self.slice_free if s == full)

    def domain(self, level: TopologyLevel) -> str:
        if level is TopologyLevel.NODE:
            return self.name
        return self.rack if level is TopologyLevel.RACK else self.block


def class_key(spec: NodeSpec) -> ClassKey:
    taints = tuple(sorted((t.key, t.value, t.effect.value) for t in spec.taints))
    return (spec.gpu_model, spec.mig.profile if spec.mig else "", taints)


class NodeClass:
    """Nodes interchangeable for eligibility: same model, MIG profile and taints. Aggregates count READY nodes.
    Read-only outside this module."""

    __slots__ = ("buckets", "cap", "dom_buckets", "dom_free", "ds_buckets", "free", "hard", "key", "max_units",
                 "mig", "model", "owner", "ready_nodes", "soft", "total_nodes")

    def __init__(self, key: ClassKey, spec: NodeSpec, owner: object):
        self.key = key
        self.model = spec.gpu_model
        self.mig = spec.mig.profile if spec.mig else None
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


@dataclass
class _NodeNeed:
    """What one placement takes on one node (commit's validation phase)."""

    mask: int = 0
    slices: dict[int, int] = field(default_factory=dict)  # gpu -> slice mask
    cpu: int = 0
    mem: int = 0


class ClusterIndex:
    """A mutable snapshot of the cluster's nodes and the placements committed on them."""

    def __init__(self, strategy: str = "binpack") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        self._gen: object = object()
        self._nodes: dict[str, IndexedNode] = {}
        self._classes: dict[ClassKey, NodeClass] = {}
        self._alloc: dict[str, Placement] = {}
        self._order: list[str] = []  # rank -> node name
        self._dom_nodes: dict[tuple[ClassKey, TopologyLevel], dict[str, list[str]]] = {}
        self._dom_rank: dict[TopologyLevel, dict[str, int]] = {}
        self._dom_order: dict[TopologyLevel, list[str]] = {}
        # Answers that depend on the node specs only (not on what is free): reset by a rebuild.
        self._spec_cache: dict[object, object] = {}
        # Answers that depend on everything the index holds (what is free, what is placed): dropped by any
        # change (commit, release, node update), so a cycle that finds the state as the last one left it
        # reuses them instead of deciding the same again (`state_memo`).
        self._state_cache: dict[object, object] = {}
        self._dirty = True
        self._refusing: frozenset[str] = frozenset()  # nodes whose spec carries refused pod shapes

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_nodes(cls: type[_I], nodes: Iterable[NodeSpec], *, strategy: str = "binpack") -> _I:
        state = cls(strategy)
        for spec in nodes:
            if spec.name in state._nodes:
                raise ValueError(f"duplicate node name {spec.name!r}")
            state._nodes[spec.name] = IndexedNode.fresh(spec, state._gen)
        state._rebuild()
        return state

    def upsert_node(self, node: NodeSpec) -> None:
        """Add a node, or update it (labels, health, taints, datasets, even capacity) keeping its allocations.

        Allocations whose GPUs no longer exist on the new spec are kept in `allocations()` but not re-applied.
        The indexes are rebuilt lazily on the next decision, so a burst of updates costs one rebuild.
        """
        old = self._nodes.get(node.name)
        if old is not None and old.spec == node:
            return
        fresh = IndexedNode.fresh(node, self._gen)
        if old is not None:
            for job_id in sorted(old.jobs):
                placement = self._alloc.get(job_id)
                if placement is not None:
                    self._reapply(fresh, placement)
        self._nodes[node.name] = fresh
        self._dirty = True
        self._state_cache.clear()

    def _reapply(self, node: IndexedNode, placement: Placement) -> None:
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

    def _rebuild(self) -> None:
        """Recompute ranks and every index from the nodes' current free state."""
        ordered = sorted(self._nodes.values(),
                         key=lambda n: (natural_key(n.block), natural_key(n.rack), natural_key(n.name)))
        self._order = [n.name for n in ordered]
        classes: dict[ClassKey, NodeClass] = {}
        dom_nodes: dict[tuple[ClassKey, TopologyLevel], dict[str, list[str]]] = {}
        for rank, n in enumerate(ordered):
            if n.owner is not self._gen:
                n = n.clone(self._gen)
                self._nodes[n.name] = n
            n.rank = rank
            c = classes.get(n.cls)
            if c is None:
                c = classes[n.cls] = NodeClass(n.cls, n.spec, self._gen)
            c.total_nodes += 1
            c.max_units = max(c.max_units, n.cap_units)
            for lvl in _LEVELS:
                dom_nodes.setdefault((n.cls, lvl), {}).setdefault(n.domain(lvl), []).append(n.name)
                c.dom_free[lvl].setdefault(n.domain(lvl), 0)
            if not n.ready:
                continue
            c.ready_nodes += 1
            c.cap += n.cap_units
            c.free += n.units
            c.buckets.setdefault(n.units, []).append(rank)  # ranks ascend: lists stay sorted
            for d in n.spec.datasets:
                c.ds_buckets.setdefault(d, {}).setdefault(n.units, []).append(rank)
            c.dom_free[TopologyLevel.RACK][n.rack] += n.units
            c.dom_free[TopologyLevel.BLOCK][n.block] += n.units
        self._classes = classes
        self._dom_nodes = dom_nodes
        self._dom_order = {lvl: sorted({n.domain(lvl) for n in ordered}, key=natural_key) for lvl in _LEVELS}
        self._dom_rank = {lvl: {d: i for i, d in enumerate(names)} for lvl, names in self._dom_order.items()}
        for c in classes.values():
            for lvl, frees in c.dom_free.items():
                ranks = self._dom_rank[lvl]
                for d in sorted(frees, key=ranks.__getitem__):
                    c.dom_buckets[lvl].setdefault(frees[d], []).append(ranks[d])
        self._refusing = frozenset(n.name for n in ordered if n.spec.refused)
        self._spec_cache = {}
        self._state_cache.clear()
        self._dirty = False

    def refresh_index(self) -> None:
        """Bring the indexes up to date after node changes (lazy: a burst of upserts costs one rebuild).
        Every reader of the index calls it once before reading."""
        if self._dirty:
            self._rebuild()

    # ------------------------------------------------------------------ copy-on-write

    def copy(self: _I) -> _I:
        """An independent index; O(nodes) pointer copies, node and class data is cloned only when written."""
        self.refresh_index()
        other = type(self).__new__(type(self))
        other.strategy = self.strategy
        other._nodes = dict(self._nodes)
        other._classes = dict(self._classes)
        other._alloc = dict(self._alloc)
        # Immutable between rebuilds (a rebuild assigns new objects), so sharing them is safe.
        other._order = self._order
        other._dom_nodes = self._dom_nodes
        other._dom_rank = self._dom_rank
        other._dom_order = self._dom_order
        other._spec_cache = self._spec_cache
        other._refusing = self._refusing
        other._state_cache = {}  # the two diverge from here: each keeps its own (a copy is a what-if)
        other._dirty = False
        # Both sides get a new generation: from now on neither owns the shared nodes and classes.
        self._gen = object()
        other._gen = object()
        return other

    def _own_node(self, name: str) -> IndexedNode:
        n = self._nodes[name]
        if n.owner is not self._gen:
            n = n.clone(self._gen)
            self._nodes[name] = n
        return n

    def _own_class(self, key: ClassKey) -> NodeClass:
        c = self._classes[key]
        if c.owner is not self._gen:
            c = c.clone(self._gen)
            self._classes[key] = c
        return c

    def _units_changed(self, node: IndexedNode, old_units: int) -> None:
        if not node.ready or node.units == old_units:
            return
        c = self._own_class(node.cls)
        bucket = c.buckets[old_units]
        del bucket[bisect_left(bucket, node.rank)]
        if not bucket:
            del c.buckets[old_units]
        insort(c.buckets.setdefault(node.units, []), node.rank)
        for d in node.spec.datasets:
            by_units = c.ds_buckets[d]
            bucket = by_units[old_units]
            del bucket[bisect_left(bucket, node.rank)]
            if not bucket:
                del by_units[old_units]
            insort(by_units.setdefault(node.units, []), node.rank)
        delta = node.units - old_units
        c.free += delta
        for lvl, d in ((TopologyLevel.RACK, node.rack), (TopologyLevel.BLOCK, node.block)):
            frees = c.dom_free[lvl]
            before = frees[d]
            frees[d] = before + delta
            by_free = c.dom_buckets[lvl]
            rank = self._dom_rank[lvl][d]
            bucket = by_free[before]
            del bucket[bisect_left(bucket, rank)]
            if not bucket:
                del by_free[before]
            insort(by_free.setdefault(before + delta, []), rank)

    # ------------------------------------------------------------------ commit / release

    def commit(self, placement: Placement) -> None:
        """Take every resource of the placement, or nothing: raises PlacementConflict if anything is taken."""
        self.refresh_index()
        if placement.job_id in self._alloc:
            raise PlacementConflict(f"job {placement.job_id} is already placed")
        if placement.requests and len(placement.requests) != len(placement.bindings):
            raise PlacementConflict(f"job {placement.job_id}: requests do not match bindings")
        # Phase 1: aggregate per node and validate against the current free state (no mutation yet).
        need: dict[str, _NodeNeed] = {}
        for i, b in enumerate(placement.bindings):
            n = self._nodes.get(b.node)
            if n is None:
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} does not exist")
            if not n.ready:
                raise PlacementConflict(f"job {placement.job_id}: node {b.node} is {n.spec.health.value}")
            entry = need.setdefault(b.node, _NodeNeed())
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
            n = self._nodes[name]
            usable = n.free_mask | n.held_mask
            if e.mask & ~usable:
                raise PlacementConflict(f"job {placement.job_id}: GPUs {_bits(e.mask & ~usable)} on {name} "
                                        "are taken")
            for g, smask in e.slices.items():
                if n.slice_free is None or smask & ~(n.slice_free[g] | _held_at(n, g)):
                    raise PlacementConflict(f"job {placement.job_id}: MIG slices on GPU {g} of {name} are taken")
            cpu, mem = n.cpu + n.spec.held.cpu_milli, n.mem + n.spec.held.memory_mib
            if e.cpu > cpu or e.mem > mem:
                raise PlacementConflict(f"job {placement.job_id}: {name} lacks CPU/memory "
                                        f"(needs {e.cpu}m/{e.mem}MiB, free {n.cpu}m/{n.mem}MiB)")
        # Phase 2: apply.
        for name, e in need.items():
            n = self._own_node(name)
            old = n.units
            took_held = bool(e.mask & n.held_mask)
            if e.mask:
                n.units -= (e.mask & n.free_mask).bit_count()
                n.free_mask &= ~e.mask
                n.held_mask &= ~e.mask
            if n.slice_free is not None:
                for g, smask in e.slices.items():
                    held = _held_at(n, g)
                    if smask & held and n.held_slices is not None:
                        n.held_slices[g] &= ~smask
                        took_held = True
                    n.units -= (smask & n.slice_free[g]).bit_count()
                    n.slice_free[g] &= ~smask
            if took_held:
                n.rehold()
            n.cpu -= e.cpu
            n.mem -= e.mem
            n.jobs.add(placement.job_id)
            self._units_changed(n, old)
        self._alloc[placement.job_id] = placement
        self._state_cache.clear()

    def release(self, job_id: str) -> None:
        """Give back everything the job holds. Unknown or already released jobs are ignored (idempotent)."""
        placement = self._alloc.pop(job_id, None)
        if placement is None:
            return
        self._state_cache.clear()
        self.refresh_index()
        self._free(placement, None)

    def release_many(self, job_ids: Iterable[str]) -> None:
        """`release` of every job named, in that order, leaving exactly the state the releases one by one leave;
        the buckets and per-domain sums of a node are moved once for all the jobs freed on it (a what-if that
        releases a whole pool of victims, or every job ending before an instant, frees many jobs per node)."""
        placements = [p for p in (self._alloc.pop(job_id, None) for job_id in job_ids) if p is not None]
        if not placements:
            return
        self._state_cache.clear()
        self.refresh_index()
        before: dict[str, int] = {}  # node -> its free units before the first of these releases
        for placement in placements:
            self._free(placement, before)
        nodes = self._nodes
        for name, old in before.items():
            self._units_changed(nodes[name], old)

    def _free(self, placement: Placement, before: dict[str, int] | None) -> None:
        """Free `placement` (already taken out of `_alloc`) on its nodes. `before` None: move each node's
        buckets now; else record each node's free units before its first change there, for the caller to move
        them once."""
        job_id = placement.job_id
        per_node: dict[str, list[int]] = {}
        for i, b in enumerate(placement.bindings):
            per_node.setdefault(b.node, []).append(i)
        for name in sorted(per_node):
            if name not in self._nodes:
                continue
            n = self._own_node(name)
            if job_id not in n.jobs:
                continue  # the node was replaced by a spec that could not hold this allocation
            old = n.units
            if before is not None:
                before.setdefault(name, old)
            for i in per_node[name]:
                b = placement.bindings[i]
                if b.mig_slice is not None and n.slice_free is not None:
                    g, s = b.mig_slice
                    if g < n.gpus and s < n.slices_per_gpu and not (n.slice_free[g] | _held_at(n, g)) >> s & 1:
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
            n.jobs.discard(job_id)
            if n.held_want and n.held_units < n.held_want:
                n.rehold()  # held units that had no room take what this release freed
            if before is None:
                self._units_changed(n, old)

    def make_placement(self, job: JobSpec, bindings: Sequence[GpuBinding]) -> Placement:
        """Rebuild a Placement from stored bindings (e.g. after a restart), with per-pod CPU/memory from the spec."""
        self.refresh_index()
        by_set = {p.name: p for p in job.pod_sets}
        requests = []
        for b in bindings:
            ps = by_set.get(b.pod.rsplit("-", 1)[0])
            requests.append((ps.cpu_milli, ps.memory_mib) if ps else (0, 0))
        return self.build_placement(job.job_id, tuple(bindings), tuple(requests))

    def build_placement(self, job_id: str, bindings: tuple[GpuBinding, ...],
                        requests: tuple[tuple[int, int], ...]) -> Placement:
        """A Placement of these bindings, with the racks and blocks they span on this index."""
        nodes = {b.node for b in bindings}
        racks = {self._nodes[n].rack for n in nodes if n in self._nodes}
        blocks = {self._nodes[n].block for n in nodes if n in self._nodes}
        return Placement(
            job_id=job_id,
            bindings=bindings,
            racks_spanned=len(racks),
            blocks_spanned=len(blocks),
            gpus=sum(len(b.gpu_indices) for b in bindings),
            mig_slices=sum(1 for b in bindings if b.mig_slice is not None),
            requests=requests,
        )

    # ------------------------------------------------------------------ the index, read-only

    @property
    def indexed_nodes(self) -> Mapping[str, IndexedNode]:
        """Node name -> its record (read-only; call `refresh_index()` first)."""
        return self._nodes

    @property
    def classes(self) -> Mapping[ClassKey, NodeClass]:
        """Class key -> the class's buckets and aggregates (read-only; call `refresh_index()` first)."""
        return self._classes

    @property
    def rank_order(self) -> Sequence[str]:
        """Rank -> node name: the deterministic (block, rack, name) order bucket ranks refer to."""
        return self._order

    def domain_members(self, key: ClassKey, level: TopologyLevel) -> Mapping[str, list[str]]:
        """Rack or block name -> the names of the class's nodes in it (every health)."""
        return self._dom_nodes.get((key, level), {})

    def domain_ranks(self, level: TopologyLevel) -> Mapping[str, int]:
        """Rack or block name -> its rank (the order `NodeClass.dom_buckets` refers to)."""
        return self._dom_rank.get(level, {})

    def domain_order(self, level: TopologyLevel) -> Sequence[str]:
        return self._dom_order.get(level, [])

    @property
    def refusing_nodes(self) -> frozenset[str]:
        """Nodes whose spec carries pod shapes they refused (`NodeSpec.refused`; call `refresh_index()` first)."""
        return self._refusing

    def spec_memo(self, key: object, compute: Callable[[], T]) -> T:
        """An answer that depends on the node specs only (eligibility, "could it ever fit"), kept until the next
        rebuild of the index."""
        hit = self._spec_cache.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._spec_cache[key] = compute()
        return hit  # type: ignore[return-value]  # stored by this method under the same key: a T

    def state_memo(self, key: object) -> object:
        """An answer remembered with `remember(key, value)` since the index last changed (a commit, a release or
        a node update drops them all), or `MISSING`. For pure queries of the whole state that a caller repeats
        on an unchanged state, e.g. a blocked head's placement and reservation search, asked again every cycle
        while nothing ends or starts. The caller keys it by everything else its answer reads."""
        return self._state_cache.get(key, _MISSING)

    def remember(self, key: object, value: object) -> None:
        self._state_cache[key] = value

    def holds(self, job_id: str) -> bool:
        """Is the job placed on this index?"""
        return job_id in self._alloc

    def placement_of(self, job_id: str) -> Placement | None:
        return self._alloc.get(job_id)

    # ------------------------------------------------------------------ summaries

    def allocations(self) -> Mapping[str, Placement]:
        return dict(self._alloc)

    def nodes(self) -> list[NodeSpec]:
        return [self._nodes[name].spec for name in sorted(self._nodes)]

    def node(self, name: str) -> NodeSpec:
        return self._nodes[name].spec

    def free_on(self, name: str) -> dict[str, int]:
        """Free resources of one node: whole GPUs (or slices), CPU, memory."""
        n = self._nodes[name]
        return {"gpus": n.free_mask.bit_count(), "mig_slices": sum(s.bit_count() for s in n.slice_free or ()),
                "cpu_milli": n.cpu, "memory_mib": n.mem}

    @property
    def total_gpus(self) -> CallableInt:
        """Physical GPUs on READY nodes (MIG-partitioned GPUs included)."""
        return CallableInt(sum(n.gpus for n in self._nodes.values() if n.ready))

    @property
    def free_gpus(self) -> CallableInt:
        """Free whole GPUs on READY nodes; a partitioned GPU counts when all of its slices are free."""
        return CallableInt(sum(n.free_whole_gpus for n in self._nodes.values() if n.ready))

    @property
    def free_mig_slices(self) -> CallableInt:
        return CallableInt(sum(sum(s.bit_count() for s in n.slice_free or ()) for n in self._nodes.values()
                               if n.ready))

    def free_gpus_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready:
                out[n.spec.gpu_model] = out.get(n.spec.gpu_model, 0) + n.free_whole_gpus
        return dict(sorted(out.items()))

    def free_slices_by_profile(self) -> dict[str, int]:
        """Free MIG slices on READY nodes per admission resource "<model>:<profile>"."""
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready and n.slice_free is not None and n.spec.mig is not None:
                key = f"{n.spec.gpu_model}:{n.spec.mig.profile}"
                out[key] = out.get(key, 0) + sum(s.bit_count() for s in n.slice_free)
        return dict(sorted(out.items()))

    def total_gpus_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self._nodes.values():
            if n.ready:
                out[n.spec.gpu_model] = out.get(n.spec.gpu_model, 0) + n.gpus
        return dict(sorted(out.items()))

    def used_gpus(self) -> int:
        return int(self.total_gpus) - int(self.free_gpus)

    def fingerprint(self) -> tuple[object, ...]:
        """Everything observable about the state, for equality checks in tests and what-if proofs."""
        nodes = tuple((n.name, n.ready, n.free_mask, tuple(n.slice_free or ()), n.cpu, n.mem, n.units,
                       tuple(sorted(n.jobs)), n.held_mask, tuple(n.held_slices or ()))
                      for n in (self._nodes[k] for k in sorted(self._nodes)))
        return nodes, tuple(sorted(self._alloc.items(), key=lambda kv: kv[0]))

    def index_fingerprint(self) -> tuple[object, ...]:
        """The incremental indexes themselves (buckets, per-domain free units), for tests proving that
        incremental updates leave exactly what a rebuild from scratch computes."""
        self.refresh_index()
        return tuple((repr(key), c.free, c.buckets, c.ds_buckets, c.dom_free, c.dom_buckets)
                     for key, c in sorted(self._classes.items(), key=lambda kv: repr(kv[0])))

    def rebuilt(self: _I) -> _I:
        """A fresh index over the same nodes and placements (the reference incremental updates must equal)."""
        other = self.copy()
        other._rebuild()
        return other


def _held_at(n: IndexedNode, gpu: int) -> int:
    return n.held_slices[gpu] if n.held_slices is not None and gpu < len(n.held_slices) else 0


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


__all__ = ["MISSING", "STRATEGIES", "CallableInt", "ClassKey", "ClusterIndex", "IndexedNode", "NodeClass",
           "natural_key"]
