"""The reservation search: the earliest expected end after which a blocked job fits.

`earliest_slot` answers exactly what the straightforward replay answers — release the running jobs in
order of expected end and, after each instant, attempt a full placement; the first that succeeds is the
reservation (instant and placement), None if none does — without attempting a placement at every instant.
(That replay cost ≈1-2 s per call on the 1,213-node openb cluster for a head limited by CPU/memory: one
attempt plus its diagnosis scans the eligible nodes, and there are hundreds of instants, every cycle.)

- A *gate* counts, for each pod set of the pods that must start (the first `min_members` pods; the whole
  gang contains them), how many of its pods fit on each eligible READY node — GPUs or MIG slices, CPU and
  memory, minus earlier reservations, exactly as the placer's staging counts them — and sums them. The
  releases are applied to a private view of the nodes the job may use (what `ClusterState.release` frees
  there), so an instant costs O(bindings released), and only the nodes it freed are recounted. While a
  pod set has fewer fitting pods than it needs, no placement exists: the placer is not called.
- When the pods that must start form one pod set, the gate is exact: its sums are kept per domain of the
  required level (one domain when there is none) and the placer places one pod set iff some domain holds
  enough fitting pods. (It takes min(fit, left) pods per node in some order, tries every candidate domain
  of a required level, falls back to every node for a preferred one, and its cheaper filters — free units
  per domain, pod-sized pieces — are implied by the count.) So the placer runs once, at the answer, and a
  job that never fits costs one pass over the expected ends.
- With several pod sets, greedy staging is not monotone in the free resources (freeing a node can move an
  earlier pod set onto what a later one needed), so the gate is only a necessary condition; the placer is
  also skipped at instants that freed nothing on a node the job may use: its answer depends only on those
  nodes, and it failed on them at the previous attempt.

Before the replay, the gate's condition is checked on whole empty nodes (capacity, no reservations), cached
until the node specs change: a job that could not fit even on an empty cluster (e.g. admitted on a flavor
whose nodes lack its CPU/memory) is answered None without a replay. The state is copied, and the releases
applied to the copy, only where the placer runs. Cost: O(eligible
nodes with room for a pod) for the gate, O(expected ends + bindings released) for the replay, plus the
placements attempted (one, or none, when one pod set must start). Nothing is capped: the answer is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.domain import JobSpec, TopologyLevel

from .index import ClassKey, ClusterIndex
from .placer import try_place
from .staging import (
    BIG,
    Exclusion,
    Free,
    PodReq,
    Stage,
    eligible,
    excluded,
    exclusions_for,
    resolve,
    shared_capacity,
)
from .staging import starting as starting_pods
from .types import PendingJob, Placement, Unplaceable


@dataclass(frozen=True)
class Reservation:
    job_id: str
    start: float
    end: float
    placement: Placement


class _Gate:
    """Pods of each pod set that fit, per eligible READY node, summed per domain, updated node by node.

    Releases are applied to a private view of the nodes the job may use (what `ClusterState.release` would
    free there), so the replay touches neither the index nor the other nodes."""

    __slots__ = ("exclude", "fit", "free", "keys", "level", "ok", "reqs", "state", "sums", "union")

    def __init__(self, state: ClusterIndex, spec: JobSpec, reqs: list[PodReq], starting: list[PodReq],
                 exclude: Mapping[str, Exclusion] | None):
        # `starting`: the pods that must start (min_members); a placement of the whole gang contains them.
        self.state = state
        self.reqs = starting
        self.exclude = exclude
        self.level = spec.topology.required_level if len(starting) == 1 else None
        self.keys: list[frozenset[ClassKey]] = [frozenset(k for _, k in eligible(state, r, spec.tolerations))
                                                for r in starting]
        # Every class the placer may read for the whole gang: a release elsewhere cannot change its answer.
        self.union = frozenset(k for r in reqs for _, k in eligible(state, r, spec.tolerations))
        self.free: dict[str, Free] = {}
        self.fit: list[dict[str, int]] = [{} for _ in starting]
        self.sums: list[dict[str, int]] = [{} for _ in starting]
        self.ok = [0] * len(starting)  # per pod set: domains holding enough fitting pods
        # Initial counts: a node with fewer free units than one pod takes fits no pod (the default, 0).
        stage = Stage(state, exclude)
        order, classes = state.rank_order, state.classes
        for i, req in enumerate(starting):
            self._recount(stage, [order[r] for key in self.keys[i] for b, ranks in classes[key].buckets.items()
                                  if b >= req.unit for r in ranks], only=i)

    def release(self, p: Placement) -> list[str]:
        """Free `p` on the view, as `ClusterState.release` does; the READY nodes the job may use it touched."""
        nodes = self.state.indexed_nodes
        touched: list[str] = []
        for i, b in enumerate(p.bindings):
            n = nodes.get(b.node)
            if n is None or not n.ready or n.cls not in self.union or p.job_id not in n.jobs:
                continue
            f = self.free.get(b.node)
            if f is None:
                f = self.free[b.node] = Free.of(n)
            if b.shared_gpu is not None:
                if f.sh_share is not None and f.sh_mem is not None and f.sh_pods is not None \
                        and b.shared_gpu < len(f.sh_share):
                    f.sh_share[b.shared_gpu] -= b.share_milli or 0
                    f.sh_mem[b.shared_gpu] -= b.gpu_memory_mib or 0
                    f.sh_pods[b.shared_gpu] -= 1
            elif b.mig_slice is not None and f.prof_free is not None:
                names = sorted(f.prof_free)
                if b.mig_slice[0] < len(names):
                    f.prof_free[names[b.mig_slice[0]]] |= 1 << b.mig_slice[1]
            elif b.mig_slice is not None and f.slice_free is not None:
                g, s = b.mig_slice
                if g < n.gpus and s < n.slices_per_gpu:
                    f.slice_free[g] |= 1 << s
            elif f.slice_free is None:
                for g in b.gpu_indices:
                    if g < n.gpus:
                        f.free_mask |= 1 << g
            if p.requests:
                f.cpu += p.requests[i][0]
                f.mem += p.requests[i][1]
            touched.append(b.node)
        return touched

    def recount(self, names: Iterable[str]) -> None:
        self._recount(Stage(self.state, self.exclude, nodes=self.free), names)

    def _recount(self, stage: Stage, names: Iterable[str], only: int | None = None) -> None:
        nodes = self.state.indexed_nodes
        for name in names:
            n = nodes[name]
            for i, req in enumerate(self.reqs):
                if n.cls not in self.keys[i] or (only is not None and i != only):
                    continue
                fit = self.fit[i]
                old = fit.get(name, 0)
                new = stage.fits(name, req)
                if new == old:
                    continue
                fit[name] = new
                d = n.domain(self.level) if self.level is not None else ""
                sums = self.sums[i]
                before = sums.get(d, 0)
                after = before + new - old
                sums[d] = after
                self.ok[i] += (after >= req.count) - (before >= req.count)

    def holds(self) -> bool:
        """Every pod set has enough fitting pods (in one domain for a one-pod-set gang with a required level)."""
        return all(self.ok)


def _ever_fits(state: ClusterIndex, spec: JobSpec, starting: list[PodReq], level: TopologyLevel | None) -> bool:
    """The gate's condition on an empty cluster (whole nodes, no reservations): False = the job never fits.

    Free resources never exceed a node's capacity, so this is necessary at every instant. It depends on the
    node specs only and is cached until the next index rebuild: a job admitted on a flavor whose nodes
    cannot hold its CPU/memory costs one lookup per cycle instead of a replay."""
    return state.spec_memo(("ever_fits", tuple(starting), spec.tolerations, level),
                           lambda: _fits_empty(state, spec, starting, level))


def _fits_empty(state: ClusterIndex, spec: JobSpec, starting: list[PodReq], level: TopologyLevel | None) -> bool:
    order, nodes, classes = state.rank_order, state.indexed_nodes, state.classes
    for req in starting:
        keys = [k for _, k in eligible(state, req, spec.tolerations)]
        barred = excluded(state, req)
        sums: dict[str, int] = {}
        for key_ in keys:
            for ranks in classes[key_].buckets.values():
                for r in ranks:
                    n = nodes[order[r]]
                    if barred and n.name in barred:
                        continue
                    k = BIG
                    if req.gpus:
                        k = (n.gpus - n.spec.shared_gpus) // req.gpus
                    elif req.mig:
                        k = n.spec.mig_profiles.get(req.mig, 0) if n.spec.mig_profiles else n.cap_units
                    elif req.shared:
                        k = shared_capacity(n.spec, req)
                    if req.cpu:
                        k = min(k, n.spec.cpu_milli // req.cpu)
                    if req.mem:
                        k = min(k, n.spec.memory_mib // req.mem)
                    d = n.domain(level) if level is not None else ""
                    sums[d] = sums.get(d, 0) + k
        if not any(v >= req.count for v in sums.values()):
            return False
    return True


def may_fit_if_released(state: ClusterIndex, spec: JobSpec, allowed: tuple[str, ...],
                        victims: Iterable[str]) -> bool | None:
    """Whether `ClusterState.fits_if_released(spec, victims, allowed)` would place the job, told by counting
    instead of placing: with the victims' resources freed on a private view (the gate above), does every pod set
    of the pods that must start have enough fitting pods on the READY nodes it may use (in one domain of a
    required level, for one pod set)? A placement puts each of those pod sets on such nodes within their free
    resources, so a no is False: no placement exists. A yes is True when those pods form one pod set, where the
    gate is exact (see the module docstring); with several, None: only the placer can tell."""
    reqs = resolve(spec, allowed)
    if isinstance(reqs, Unplaceable):
        return False
    state.refresh_index()
    starting = starting_pods(spec, reqs)
    gate = _Gate(state, spec, reqs, starting, None)
    touched: list[str] = []
    for job_id in set(victims):  # each once: the view adds CPU and memory back per release
        placement = state.placement_of(job_id)
        if placement is not None:
            touched.extend(gate.release(placement))
    if touched:
        gate.recount(dict.fromkeys(touched))
    if not gate.holds():
        return False
    return True if len(starting) == 1 else None


def earliest_slot(state: ClusterIndex, pj: PendingJob, timeline: Sequence[tuple[float, str]],
                  earlier: Sequence[Reservation], now: float) -> Reservation | None:
    """When and where the job starts if the running jobs end as expected (`timeline`: (expected end, job id)),
    avoiding `earlier` reservations: the first instant after which the placer places it; None if none does.
    A pure query: `state` is not changed."""
    found = earliest_instant(state, pj, timeline, earlier)
    if found is None:
        return None
    t, placement = found
    start = max(now, t)
    return Reservation(pj.spec.job_id, start, start + pj.spec.max_runtime_s, placement)


def earliest_instant(state: ClusterIndex, pj: PendingJob, timeline: Sequence[tuple[float, str]],
                     earlier: Sequence[Reservation]) -> tuple[float, Placement] | None:
    """`earliest_slot`'s search: the first expected end after which the job is placed, and where (the instant
    may be in the past: an overrunning job's expected end). It does not read the time."""
    spec = pj.spec
    reqs = resolve(spec, pj.allowed_models)
    if isinstance(reqs, Unplaceable) or not timeline:
        return None
    state.refresh_index()
    events = sorted(timeline)  # usually sorted already (timsort: linear); jobs not running are skipped below
    starting = starting_pods(spec, reqs)
    if not _ever_fits(state, spec, starting, spec.topology.required_level if len(starting) == 1 else None):
        return None
    exclude = exclusions_for(r.placement for r in earlier) if earlier else None
    gate = _Gate(state, spec, reqs, starting, exclude)
    future: ClusterIndex | None = None  # the state itself, brought up to date only where the placer runs
    synced = 0  # events released on `future`
    released: set[str] = set()
    changed = True  # something the job may use was freed since the last attempt that failed
    i = 0
    while i < len(events):
        t = events[i][0]
        touched: list[str] = []
        freed = False
        while i < len(events) and events[i][0] == t:
            job_id = events[i][1]
            placement = state.placement_of(job_id)
            if placement is not None and job_id not in released:  # a job named twice is released once
                released.add(job_id)
                touched.extend(gate.release(placement))
                freed = True
            i += 1
        if not freed:
            continue  # nothing ended here: the state is the one the previous instant saw
        if touched:
            gate.recount(dict.fromkeys(touched))
            changed = True
        if not changed or not gate.holds():
            continue
        if future is None:
            future = state.copy()
        # idempotent: jobs not running, or named twice, change nothing
        future.release_many(job_id for _, job_id in events[synced:i])
        synced = i
        got = try_place(future, spec, reqs, exclude)
        if got is not None:
            return t, got
        changed = False
    return None


__all__ = ["Reservation", "earliest_instant", "earliest_slot", "may_fit_if_released"]
