"""Gang placement: stage every pod of a job on a scratch overlay, return the whole placement or nothing.

Like Volcano's Statement, nothing is written to the index while staging: `place_job` is a pure query and
`ClusterIndex.commit` applies the result later (or raises if the snapshot moved on meanwhile).

Score, lexicographic (documented in docs/scheduler.md):
0. a pod set with preferred node affinity: the nodes its terms weigh most first (nodes its nodeSelector or
   required node affinity does not match are never used: `Stage.fits` holds no pod there);
1. fewest untolerated PreferNoSchedule taints (the taint only lowers the score);
2. binpack: fewest free units on the node first (spread: most free first) -- keeps whole nodes free;
3. nodes caching one of the job's datasets first;
4. node rank (block, rack, name): fills racks one after another, keeping other racks whole.

Topology (Kueue TAS): `required_level` tries the domains of that level in best-fit order (smallest free
capacity that suffices) and fails if none holds the gang; `preferred_level` does the same and climbs a
level only when no domain fits, and finally spreads over the cluster taking the largest domains first
(rack free 3,3,2,1 and 7 pods -> 3+3+1) so the gang spans as few domains as possible.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence

from shared.domain import TOPOLOGY_LEVELS, GpuBinding, JobSpec, TopologyLevel

from .diagnose import diagnose
from .index import ClassKey, ClusterIndex, NodeClass
from .staging import (
    Eligibility,
    Exclusion,
    GangRequest,
    PodReq,
    Stage,
    at_pods,
    domain_free,
    exclusions_for,
    preference,
    prepare,
    resolve,
    starting,
    trim,
)
from .types import Placement, Unplaceable

Staged = tuple[list[GpuBinding], list[tuple[int, int]]]


def _fill(stage: Stage, req: PodReq, names: Iterable[str], out: list[GpuBinding],
          reqs_out: list[tuple[int, int]]) -> bool:
    """Place the `count` pods of `req` on `names` in order, as many per node as fit. True when all placed.

    Pods sharing a GPU go in two passes over the same nodes: first onto GPUs some pod shares already, then onto
    idle shared GPUs (opened to sharing only when the GPUs already shared cannot hold them all)."""
    if req.shared:
        names = list(names)
        stage.opened_only = True
        try:
            placed = _fill_some(stage, req, names, out, reqs_out, 0)
        finally:
            stage.opened_only = False
        return placed == req.count or _fill_some(stage, req, names, out, reqs_out, placed) == req.count
    return _fill_some(stage, req, names, out, reqs_out, 0) == req.count


def _fill_some(stage: Stage, req: PodReq, names: Iterable[str], out: list[GpuBinding],
               reqs_out: list[tuple[int, int]], placed: int) -> int:
    """`_fill`'s pass: pods `placed`.. of `req` on `names` in order, as many per node as fit; how many are placed
    after it."""
    for name in names:
        k = stage.fits(name, req)
        if k <= 0:
            continue
        k = min(k, req.count - placed)
        stage.take(name, req, placed, k, out, reqs_out)
        placed += k
        if placed == req.count:
            return placed
    return placed


# ---------------------------------------------------------------------------------- node orders


def _groups(state: ClusterIndex, elig: Eligibility) -> list[list[NodeClass]]:
    """Eligible classes grouped by penalty, best first."""
    out: list[list[NodeClass]] = []
    last = None
    classes = state.classes
    for penalty, key in elig:
        if penalty != last:
            out.append([])
            last = penalty
        out[-1].append(classes[key])
    return out


def iter_index(state: ClusterIndex, elig: Eligibility, unit_min: int,
               datasets: tuple[str, ...] = ()) -> Iterator[str]:
    """Ready nodes of the eligible classes with at least `unit_min` free units, in score order, from the
    buckets: a 1-GPU decision reads one bucket head instead of scanning the cluster."""
    binpack = state.strategy == "binpack"
    order = state.rank_order
    datasets = tuple(sorted(set(datasets)))
    for group in _groups(state, elig):
        top = max(c.max_units for c in group)
        levels = range(unit_min, top + 1) if binpack else range(top, unit_min - 1, -1)
        for b in levels:
            lists = [c.buckets[b] for c in group if b in c.buckets]
            if not lists:
                continue
            cached = [c.ds_buckets[d][b] for c in group for d in datasets
                      if d in c.ds_buckets and b in c.ds_buckets[d]] if datasets else []
            if cached:
                yield from _with_cached_first(order, lists, cached, binpack)
                continue
            ranks: Iterable[int]
            if len(lists) == 1:
                ranks = lists[0] if binpack else reversed(lists[0])
            elif binpack:
                ranks = heapq.merge(*lists)
            else:
                ranks = heapq.merge(*(reversed(x) for x in lists), reverse=True)
            for r in ranks:
                yield order[r]


def _preferred_first(state: ClusterIndex, req: PodReq, elig: Eligibility, datasets: tuple[str, ...]
                     ) -> Iterator[str]:
    """`iter_index` with the nodes its preferred node affinity scores highest first: a pass over the index per
    distinct score (few: sums of a handful of weights), lazily, so a fit among the preferred nodes reads no more."""
    scores = preference(state, req)
    for level in (*sorted(set(scores.values()), reverse=True), 0):
        for name in iter_index(state, elig, req.unit, datasets):
            if scores.get(name, 0) == level:
                yield name


def _with_cached_first(order: Sequence[str], lists: list[list[int]], cached: list[list[int]], binpack: bool
                       ) -> Iterator[str]:
    """One bucket: the nodes caching a dataset first, then the others (lazily: usually one node is read)."""
    merged = heapq.merge(*cached) if binpack else heapq.merge(*(reversed(x) for x in cached), reverse=True)
    seen: set[int] = set()
    for r in merged:
        if r not in seen:
            seen.add(r)
            yield order[r]
    rest = heapq.merge(*lists) if binpack else heapq.merge(*(reversed(x) for x in lists), reverse=True)
    for r in rest:
        if r not in seen:
            yield order[r]


def _binpack_sorted(state: ClusterIndex, names: Iterable[str], penalty: Mapping[ClassKey, int],
                    datasets: tuple[str, ...]) -> list[str]:
    nodes = state.indexed_nodes
    sign = 1 if state.strategy == "binpack" else -1
    ds = set(datasets)

    def key(name: str) -> tuple[int, int, int, int]:
        n = nodes[name]
        cached = 0 if ds and ds.intersection(n.spec.datasets) else 1
        return (penalty[n.cls], sign * n.units, cached, n.rank)

    return sorted(names, key=key)


def _greedy_groups(caps: Mapping[str, int], ranks: Mapping[str, int], need: int) -> list[str]:
    """Kueue TAS: take the largest domains while none alone holds the rest, then the smallest that does."""
    remaining = sorted(caps, key=lambda d: (-caps[d], ranks.get(d, 0), d))
    chosen: list[str] = []
    rem = need
    while rem > 0 and remaining:
        fitting = [d for d in remaining if caps[d] >= rem]
        d = min(fitting, key=lambda d: (caps[d], ranks.get(d, 0), d)) if fitting else remaining[0]
        chosen.append(d)
        remaining.remove(d)
        rem -= caps[d]
    # The estimate counts units, not pods: keep the other domains as a fallback, best fit first.
    chosen.extend(sorted(remaining, key=lambda d: (caps[d], ranks.get(d, 0), d)))
    return chosen


def _grouped_order(state: ClusterIndex, names: list[str], levels: Sequence[TopologyLevel], need: int,
                   penalty: Mapping[ClassKey, int], datasets: tuple[str, ...]) -> list[str]:
    if not levels:
        return _binpack_sorted(state, names, penalty, datasets)
    level = levels[0]
    groups: dict[str, list[str]] = {}
    caps: dict[str, int] = {}
    nodes = state.indexed_nodes
    for name in names:
        n = nodes[name]
        d = n.domain(level)
        groups.setdefault(d, []).append(name)
        caps[d] = caps.get(d, 0) + n.units
    ranks = state.domain_ranks(level) or {nm: nodes[nm].rank for nm in groups}
    out: list[str] = []
    rem = need
    for d in _greedy_groups(caps, ranks, need):
        out.extend(_grouped_order(state, groups[d], levels[1:], max(min(rem, caps[d]), 1), penalty, datasets))
        rem = max(rem - caps[d], 0)
    return out


# ---------------------------------------------------------------------------------- strategies


def _fill_all(state: ClusterIndex, job: GangRequest, names: Sequence[str] | None,
              exclude: Mapping[str, Exclusion] | None) -> Staged | None:
    """Stage every pod set; with `names`, only on those nodes in that order, else from the index."""
    stage = Stage(state, exclude)
    nodes = state.indexed_nodes
    out: list[GpuBinding] = []
    reqs_out: list[tuple[int, int]] = []
    for req, elig in zip(job.reqs, job.eligs, strict=True):
        if not elig:
            return None
        prefers = req.select is not None and req.select.prefers
        if names is None:
            it: Iterable[str] = (_preferred_first(state, req, elig, job.spec.datasets) if prefers
                                 else iter_index(state, elig, req.unit, job.spec.datasets))
        else:
            keys = {k for _, k in elig}
            it = (n for n in names if nodes[n].cls in keys)
            if prefers:  # stable: the topology order within equal scores
                scores = preference(state, req)
                it = sorted(it, key=lambda n: -scores.get(n, 0))
        if not _fill(stage, req, it, out, reqs_out):
            return None
    return out, reqs_out


def _domain_nodes(state: ClusterIndex, job: GangRequest, level: TopologyLevel, domain: str) -> list[str]:
    names: list[str] = []
    for key in job.union:
        names.extend(state.domain_members(key, level).get(domain, ()))
    nodes = state.indexed_nodes
    return [n for n in names if nodes[n].ready]


def _shapes_fit(state: ClusterIndex, job: GangRequest, names: list[str]) -> bool:
    """Necessary condition, GPUs only: every pod set finds enough pod-sized pieces of free units."""
    nodes = state.indexed_nodes
    for req, elig in zip(job.reqs, job.eligs, strict=True):
        if req.unit <= 1:
            continue  # any free unit fits a pod: the units check already covered it
        keys = {k for _, k in elig}
        pods = 0
        for name in names:
            n = nodes[name]
            if n.cls in keys:
                pods += n.units // req.unit
        if pods < req.count:
            return False
    return True


def _best_fit_domains(state: ClusterIndex, job: GangRequest, level: TopologyLevel) -> Iterator[str]:
    """Domains with at least the gang's units free, smallest sufficient first (spread: largest first).

    One eligible class (the common case): read its per-level buckets. Several: sum their free units."""
    binpack = state.strategy == "binpack"
    if len(job.union) == 1:
        c = state.classes[next(iter(job.union))]
        order = state.domain_order(level)
        by_free = c.dom_buckets[level]
        frees = sorted((f for f in by_free if f >= job.need), reverse=not binpack)
        for f in frees:
            for r in (by_free[f] if binpack else reversed(by_free[f])):
                yield order[r]
        return
    totals = domain_free(state, job.union, level)
    ranks = state.domain_ranks(level)
    sign = 1 if binpack else -1
    yield from sorted((d for d, f in totals.items() if f >= job.need),
                      key=lambda d: (sign * totals[d], ranks.get(d, 0), d))


def _in_one_domain(state: ClusterIndex, job: GangRequest, level: TopologyLevel, group_levels: list[TopologyLevel],
                   exclude: Mapping[str, Exclusion] | None) -> Staged | None:
    """Best-fit over the domains of `level`: the smallest free capacity that holds the gang."""
    if level is TopologyLevel.NODE:
        single = tuple((p, k) for k, p in sorted(job.union.items(), key=lambda kv: (kv[1], repr(kv[0]))))
        for name in iter_index(state, single, job.need, job.spec.datasets):
            got = _fill_all(state, job, [name], exclude)
            if got is not None:
                return got
        return None
    candidates = _best_fit_domains(state, job, level)
    for d in candidates:
        names = _domain_nodes(state, job, level, d)
        if not _shapes_fit(state, job, names):
            continue  # enough free units, but not in pod-sized pieces: skip the costly dry run
        ordered = _grouped_order(state, names, group_levels, job.need, job.union, job.spec.datasets)
        got = _fill_all(state, job, ordered, exclude)
        if got is not None:
            return got
    return None


def _levels_between(top: TopologyLevel, bottom: TopologyLevel) -> list[TopologyLevel]:
    """Levels strictly below `top` down to `bottom` included, largest first: how to group inside a domain."""
    return [lvl for lvl in reversed(TOPOLOGY_LEVELS) if bottom.rank <= lvl.rank < top.rank]


def _everywhere_grouped(state: ClusterIndex, job: GangRequest, bottom: TopologyLevel,
                        exclude: Mapping[str, Exclusion] | None
                        ) -> Staged | None:
    names: list[str] = []
    order = state.rank_order
    for key in job.union:
        c = state.classes[key]
        for b, ranks in c.buckets.items():
            if b > 0 or job.need == 0:
                names.extend(order[r] for r in ranks)
    levels = [TopologyLevel.BLOCK, *_levels_between(TopologyLevel.BLOCK, bottom)]
    ordered = _grouped_order(state, names, levels, job.need, job.union, job.spec.datasets)
    return _fill_all(state, job, ordered, exclude)


def _attempt(state: ClusterIndex, job: GangRequest, exclude: Mapping[str, Exclusion] | None
             ) -> Staged | None:
    topo = job.spec.topology
    if topo.required_level is not None:
        # Inside the required domain, group by racks (a required block) so the gang spans few racks;
        # single nodes are left to binpack.
        level = topo.required_level
        return _in_one_domain(state, job, level, _levels_between(level, TopologyLevel.RACK), exclude)
    if topo.preferred_level is not None:
        preferred = topo.preferred_level
        for level in TOPOLOGY_LEVELS[preferred.rank:]:
            got = _in_one_domain(state, job, level, _levels_between(level, preferred), exclude)
            if got is not None:
                return got
        return _everywhere_grouped(state, job, preferred, exclude)
    return _fill_all(state, job, None, exclude)


def _search(state: ClusterIndex, spec: JobSpec, reqs: list[PodReq], exclude: Mapping[str, Exclusion] | None
            ) -> Staged | None:
    """The whole gang, else (min_members) its first `gang_size` pods, else (elastic) the most pods that fit, at
    least its floors; None when none fits."""
    got = _attempt(state, prepare(state, spec, reqs), exclude)
    if got is None and spec.elastic:
        return _largest(state, spec, reqs, exclude)
    if got is None and spec.gang_size < spec.total_pods:
        got = _attempt(state, prepare(state, spec, trim(reqs, spec.gang_size)), exclude)
    return got


def _largest(state: ClusterIndex, spec: JobSpec, reqs: list[PodReq], exclude: Mapping[str, Exclusion] | None
             ) -> Staged | None:
    """An elastic job that does not fit whole starts with what fits: the most pods (min_pods..total_pods - 1) a
    placement holds, found by bisection (a placement of n pods leaves room for n - 1 of the same gang)."""
    lo, hi = spec.min_pods, spec.total_pods - 1
    best = _attempt(state, prepare(state, spec, at_pods(spec, reqs, lo)), exclude)
    if best is None:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        got = _attempt(state, prepare(state, spec, at_pods(spec, reqs, mid)), exclude)
        if got is None:
            hi = mid - 1
        else:
            lo, best = mid, got
    return best


def _search_as_queue(state: ClusterIndex, spec: JobSpec, reqs: list[PodReq],
                     exclude: Mapping[str, Exclusion] | None) -> Staged | None:
    """`_search` with the strategy of the job's queue (queues.yaml `placement_strategy`), the index's otherwise:
    the node orders read `state.strategy`, which is the queue's for the length of this search only."""
    own = state.strategy_for(spec.queue)
    if own == state.strategy:
        return _search(state, spec, reqs, exclude)
    default, state.strategy = state.strategy, own
    try:
        return _search(state, spec, reqs, exclude)
    finally:
        state.strategy = default


def place_job(state: ClusterIndex, spec: JobSpec, allowed: tuple[str, ...],
              exclude: Mapping[str, Exclusion] | None = None) -> Placement | Unplaceable:
    state.refresh_index()
    reqs = resolve(spec, allowed)
    if isinstance(reqs, Unplaceable):
        return reqs
    got = _search_as_queue(state, spec, reqs, exclude)
    if got is None:
        return diagnose(state, spec, prepare(state, spec, starting(spec, reqs)), exclude)
    bindings, requests = got
    return state.build_placement(spec.job_id, tuple(bindings), tuple(requests))


def try_place(state: ClusterIndex, spec: JobSpec, reqs: list[PodReq],
              exclude: Mapping[str, Exclusion] | None = None) -> Placement | None:
    """`place_job` without the diagnosis: the same placement, or None where it would explain a refusal.

    For callers that only need to know whether (and where) the gang fits, e.g. the reservation search,
    which asks at many instants and would otherwise pay for a message it discards each time."""
    state.refresh_index()
    got = _search_as_queue(state, spec, reqs, exclude)
    if got is None:
        return None
    bindings, requests = got
    return state.build_placement(spec.job_id, tuple(bindings), tuple(requests))


__all__ = ["Exclusion", "PodReq", "exclusions_for", "iter_index", "place_job", "resolve", "trim", "try_place"]
