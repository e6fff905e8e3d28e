"""The cluster index the placement core decides on: nodes, their free GPUs/slices/CPU/memory, and indexes.

Indexes (so that a decision does not scan every node):
- nodes are grouped into *classes* (same GPU model, MIG profile, taints and GPU sharing: the nodes a pod either can or
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
outside this module and its summing part, capacity.py, reads a private field): `refresh_index()`, `indexed_nodes`,
`classes`, `rank_order`, `domain_members()`, `domain_ranks()`, `domain_order()`, `spec_memo()`, `holds()`,
`placement_of()`, `allocations()`, `nodes()`, plus the summaries of capacity.py (`free_on()`, `free_gpus`, ...).
`IndexedNode` and `NodeClass` (nodes.py) are the read-only records those return: callers never write to them.
How a placement takes and gives back a node's resources is claims.py's; this module keeps the maps, the ranks, the
copy-on-write and the memos.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from shared.domain import GpuBinding, JobSpec, NodeSpec, TopologyLevel

from .capacity import CapacitySummary
from .claims import give_back, needs_of, retake, take
from .nodes import CallableInt, ClassKey, IndexedNode, NodeClass, natural_key
from .types import Placement, PlacementConflict

STRATEGIES = ("binpack", "spread")
_LEVELS = (TopologyLevel.RACK, TopologyLevel.BLOCK)

T = TypeVar("T")
_I = TypeVar("_I", bound="ClusterIndex")
_MISSING = object()
MISSING = _MISSING  # what `state_memo` returns for an answer it does not hold


class ClusterIndex(CapacitySummary):
    """A mutable snapshot of the cluster's nodes and the placements committed on them."""

    def __init__(self, strategy: str = "binpack") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        # queue -> its own strategy (queues.yaml `placement_strategy`), used for that queue's jobs instead of
        # `strategy` (`strategy_for`); set with `set_queue_strategies`
        self.queue_strategies: Mapping[str, str] = {}
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
    def from_nodes(cls: type[_I], nodes: Iterable[NodeSpec], *, strategy: str = "binpack",
                   queue_strategies: Mapping[str, str] | None = None) -> _I:
        state = cls(strategy)
        if queue_strategies:
            state.set_queue_strategies(queue_strategies)
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
                    retake(fresh, placement)
        self._nodes[node.name] = fresh
        self._dirty = True
        self._state_cache.clear()


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

    def set_queue_strategies(self, strategies: Mapping[str, str]) -> None:
        """Per queue, the strategy its jobs are placed with (binpack or spread); other queues' jobs use `strategy`.
        Decisions remembered on the state are dropped (a placement depends on the strategy)."""
        bad = sorted(f"{q}: {s!r}" for q, s in strategies.items() if s not in STRATEGIES)
        if bad:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}; got {', '.join(bad)}")
        own = {q: s for q, s in sorted(strategies.items()) if s != self.strategy}
        if own != dict(self.queue_strategies):
            self.queue_strategies = own
            self._state_cache.clear()

    def strategy_for(self, queue: str) -> str:
        """The strategy a job of `queue` is placed with."""
        return self.queue_strategies.get(queue, self.strategy) if self.queue_strategies else self.strategy

    # ------------------------------------------------------------------ copy-on-write

    def copy(self: _I) -> _I:
        """An independent index; O(nodes) pointer copies, node and class data is cloned only when written."""
        self.refresh_index()
        other = type(self).__new__(type(self))
        other.strategy = self.strategy
        other.queue_strategies = self.queue_strategies
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
        self._own_class(node.cls).move_node(node, old_units, self._dom_rank)

    # ------------------------------------------------------------------ commit / release

    def commit(self, placement: Placement) -> None:
        """Take every resource of the placement, or nothing: raises PlacementConflict if anything is taken."""
        self.refresh_index()
        if placement.job_id in self._alloc:
            raise PlacementConflict(f"job {placement.job_id} is already placed")
        if placement.requests and len(placement.requests) != len(placement.bindings):
            raise PlacementConflict(f"job {placement.job_id}: requests do not match bindings")
        need = needs_of(placement, self._nodes)  # validates everything before anything changes
        for name, e in need.items():
            n = self._own_node(name)
            old = n.units
            take(n, e, placement.job_id)
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
            give_back(n, placement, per_node[name])
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

    def fingerprint(self) -> tuple[object, ...]:
        """Everything observable about the state, for equality checks in tests and what-if proofs."""
        nodes = tuple((n.name, n.ready, n.free_mask, tuple(n.slice_free or ()), n.cpu, n.mem, n.units,
                       tuple(sorted(n.jobs)), n.held_mask, tuple(n.held_slices or ()))
                      + ((tuple(n.sh_share or ()), tuple(n.sh_mem or ()), tuple(n.sh_pods or ()),
                          tuple(sorted((n.prof_free or {}).items())))
                         if n.sh_share is not None or n.prof_free is not None else ())
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



__all__ = ["MISSING", "STRATEGIES", "CallableInt", "ClassKey", "ClusterIndex", "IndexedNode", "NodeClass",
           "natural_key"]
