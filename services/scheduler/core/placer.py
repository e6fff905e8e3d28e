"""Gang placement: stage every pod of a job on a scratch overlay, return the whole placement or nothing.

Like Volcano's Statement, nothing is written to the state while staging: `place_job` is a pure query and
`ClusterState.commit` applies the result later (or raises if the snapshot moved on meanwhile).

Score, lexicographic (documented in docs/scheduler.md):
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
from dataclasses import dataclass

from shared.domain import TOPOLOGY_LEVELS, GpuBinding, JobSpec, Toleration, TopologyLevel

from .state import ClusterState, _Class, build_placement
from .types import Placement, Reason, Unplaceable

_BIG = 1 << 62


@dataclass(frozen=True, slots=True)
class PodReq:
    """One pod set resolved against admission's flavors: what each of its `count` pods needs."""

    pod_set: str
    count: int
    gpus: int  # whole GPUs per pod (0 for MIG and CPU-only pods)
    mig: str | None
    cpu: int
    mem: int
    models: tuple[str, ...]  # empty = any model

    @property
    def unit(self) -> int:
        """Units per pod: whole GPUs on plain nodes, one slice on MIG nodes, none for CPU-only pods."""
        return 1 if self.mig else self.gpus

    @property
    def need(self) -> int:
        return self.count * self.unit


@dataclass(frozen=True, slots=True)
class Exclusion:
    """Resources on one node that a placement must not use (a reservation's future GPUs, CPU, memory)."""

    mask: int
    slices: tuple[tuple[int, int], ...]  # (gpu, slice mask)
    cpu: int
    mem: int


def exclusions_for(placements: Iterable[Placement]) -> dict[str, Exclusion]:
    acc: dict[str, list[object]] = {}
    for p in placements:
        for i, b in enumerate(p.bindings):
            e = acc.setdefault(b.node, [0, {}, 0, 0])
            for g in b.gpu_indices:
                e[0] = e[0] | (1 << g)  # type: ignore[operator]
            if b.mig_slice is not None:
                sl: dict[int, int] = e[1]  # type: ignore[assignment]
                sl[b.mig_slice[0]] = sl.get(b.mig_slice[0], 0) | (1 << b.mig_slice[1])
            if p.requests:
                e[2] = e[2] + p.requests[i][0]  # type: ignore[operator]
                e[3] = e[3] + p.requests[i][1]  # type: ignore[operator]
    return {n: Exclusion(e[0], tuple(sorted(e[1].items())), e[2], e[3])  # type: ignore[arg-type,union-attr]
            for n, e in acc.items()}


# ---------------------------------------------------------------------------------- requirements


def resolve(job: JobSpec, allowed: tuple[str, ...]) -> list[PodReq] | Unplaceable:
    reqs = []
    for ps in job.pod_sets:
        models = ps.gpu_models
        if allowed and (ps.gpus_per_pod > 0 or ps.mig_profile):
            models = tuple(m for m in allowed if not ps.gpu_models or m in ps.gpu_models)
            if not models:
                return Unplaceable(job.job_id, Reason.NO_GPU_MODEL,
                                   f"pod set {ps.name} accepts {_models(ps.gpu_models)} but admission allowed "
                                   f"{_models(allowed)}")
        gpus = 0 if ps.mig_profile else ps.gpus_per_pod
        reqs.append(PodReq(ps.name, ps.count, gpus, ps.mig_profile, ps.cpu_milli, ps.memory_mib, models))
    return reqs


def trim(reqs: list[PodReq], pods: int) -> list[PodReq]:
    """Keep the first `pods` pods in pod-set order (min_members: the gang may start with fewer pods)."""
    out = []
    for r in reqs:
        if pods <= 0:
            break
        take = min(r.count, pods)
        out.append(PodReq(r.pod_set, take, r.gpus, r.mig, r.cpu, r.mem, r.models))
        pods -= take
    return out


def eligible(state: ClusterState, req: PodReq, tolerations: tuple[Toleration, ...]
             ) -> tuple[tuple[int, tuple[object, ...]], ...]:
    """(penalty, class key) of the classes a pod of `req` may use, best penalty first (cached per state index)."""
    cache_key = (req.models, req.mig, req.gpus > 0, tolerations)
    hit = state._elig_cache.get(cache_key)
    if hit is not None:
        return hit
    out = []
    for key, c in state._classes.items():
        if req.models and c.model not in req.models:
            continue
        if req.mig is not None:
            if c.mig != req.mig:
                continue
        elif req.gpus > 0 and c.mig is not None:
            continue  # whole-GPU pods never land on a partitioned node
        if any(not any(t.tolerates(taint) for t in tolerations) for taint in c.hard):
            continue
        penalty = sum(1 for taint in c.soft if not any(t.tolerates(taint) for t in tolerations))
        out.append((penalty, key))
    result = tuple(sorted(out, key=lambda pk: (pk[0], repr(pk[1]))))
    state._elig_cache[cache_key] = result
    return result


# ---------------------------------------------------------------------------------- staging overlay


class Stage:
    """Scratch copy of the free resources of the nodes a placement touches; the state is never written."""

    __slots__ = ("exclude", "nodes", "slots", "state")

    def __init__(self, state: ClusterState, exclude: Mapping[str, Exclusion] | None):
        self.state = state
        self.exclude = exclude
        self.slots: dict[str, list[object]] = {}
        self.nodes = state._nodes

    def avail(self, name: str) -> list[object]:
        s = self.slots.get(name)
        if s is None:
            n = self.nodes[name]
            mask, sl, cpu, mem = n.free_mask, (list(n.slice_free) if n.slice_free is not None else None), n.cpu, n.mem
            e = self.exclude.get(name) if self.exclude else None
            if e is not None:
                mask &= ~e.mask
                if sl is not None:
                    for g, smask in e.slices:
                        if g < len(sl):
                            sl[g] &= ~smask
                cpu -= e.cpu
                mem -= e.mem
            s = self.slots[name] = [mask, sl, cpu, mem]
        return s

    def fits(self, name: str, req: PodReq) -> int:
        s = self.avail(name)
        k = _BIG
        if req.gpus:
            k = s[0].bit_count() // req.gpus  # type: ignore[union-attr]
        elif req.mig:
            k = sum(x.bit_count() for x in s[1])  # type: ignore[union-attr]
        if req.cpu:
            k = min(k, s[2] // req.cpu)  # type: ignore[operator]
        elif s[2] < 0:  # type: ignore[operator]
            k = 0
        if req.mem:
            k = min(k, s[3] // req.mem)  # type: ignore[operator]
        elif s[3] < 0:  # type: ignore[operator]
            k = 0
        return max(k, 0)

    def take(self, name: str, req: PodReq, first_index: int, k: int, out: list[GpuBinding],
             reqs_out: list[tuple[int, int]]) -> None:
        s = self.slots[name]
        for i in range(k):
            pod = f"{req.pod_set}-{first_index + i}"
            if req.gpus:
                mask: int = s[0]  # type: ignore[assignment]
                picked = []
                while len(picked) < req.gpus:
                    low = mask & -mask
                    picked.append(low.bit_length() - 1)
                    mask ^= low
                s[0] = mask
                out.append(GpuBinding(pod=pod, node=name, gpu_indices=tuple(picked)))
            elif req.mig:
                sl: list[int] = s[1]  # type: ignore[assignment]
                # Pack slices: the GPU with the fewest free slices left (lowest index on ties).
                g = min((i for i in range(len(sl)) if sl[i]), key=lambda i: (sl[i].bit_count(), i))
                low = sl[g] & -sl[g]
                sl[g] ^= low
                out.append(GpuBinding(pod=pod, node=name, mig_slice=(g, low.bit_length() - 1)))
            else:
                out.append(GpuBinding(pod=pod, node=name))
            s[2] = s[2] - req.cpu  # type: ignore[operator]
            s[3] = s[3] - req.mem  # type: ignore[operator]
            reqs_out.append((req.cpu, req.mem))


def _fill(stage: Stage, req: PodReq, names: Iterable[str], out: list[GpuBinding],
          reqs_out: list[tuple[int, int]]) -> bool:
    """Place the `count` pods of `req` on `names` in order, as many per node as fit. True when all placed."""
    placed = 0
    for name in names:
        k = stage.fits(name, req)
        if k <= 0:
            continue
        k = min(k, req.count - placed)
        stage.take(name, req, placed, k, out, reqs_out)
        placed += k
        if placed == req.count:
            return True
    return placed == req.count


# ---------------------------------------------------------------------------------- node orders


def _groups(state: ClusterState, elig: Sequence[tuple[int, tuple[object, ...]]]) -> list[list[_Class]]:
    """Eligible classes grouped by penalty, best first."""
    out: list[list[_Class]] = []
    last = None
    for penalty, key in elig:
        if penalty != last:
            out.append([])
            last = penalty
        out[-1].append(state._classes[key])
    return out


def iter_index(state: ClusterState, elig: Sequence[tuple[int, tuple[object, ...]]], unit_min: int,
               datasets: tuple[str, ...] = ()) -> Iterator[str]:
    """Ready nodes of the eligible classes with at least `unit_min` free units, in score order, from the
    buckets: a 1-GPU decision reads one bucket head instead of scanning the cluster."""
    binpack = state.strategy == "binpack"
    order = state._order
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


def _with_cached_first(order: list[str], lists: list[list[int]], cached: list[list[int]], binpack: bool
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


def _binpack_sorted(state: ClusterState, names: Iterable[str], penalty: Mapping[tuple[object, ...], int],
                    datasets: tuple[str, ...]) -> list[str]:
    nodes = state._nodes
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


def _grouped_order(state: ClusterState, names: list[str], levels: Sequence[TopologyLevel], need: int,
                   penalty: Mapping[tuple[object, ...], int], datasets: tuple[str, ...]) -> list[str]:
    if not levels:
        return _binpack_sorted(state, names, penalty, datasets)
    level = levels[0]
    groups: dict[str, list[str]] = {}
    caps: dict[str, int] = {}
    for name in names:
        n = state._nodes[name]
        d = n.domain(level)
        groups.setdefault(d, []).append(name)
        caps[d] = caps.get(d, 0) + n.units
    ranks = state._dom_rank.get(level) or {nm: state._nodes[nm].rank for nm in groups}
    out: list[str] = []
    rem = need
    for d in _greedy_groups(caps, ranks, need):
        out.extend(_grouped_order(state, groups[d], levels[1:], max(min(rem, caps[d]), 1), penalty, datasets))
        rem = max(rem - caps[d], 0)
    return out


# ---------------------------------------------------------------------------------- strategies


@dataclass
class _Job:
    spec: JobSpec
    reqs: list[PodReq]
    eligs: list[tuple[tuple[int, tuple[object, ...]], ...]]
    union: dict[tuple[object, ...], int]  # class key -> best penalty over pod sets
    need: int  # units of the whole gang
    pods: int


def _prepare(state: ClusterState, spec: JobSpec, reqs: list[PodReq]) -> _Job:
    eligs = [eligible(state, r, spec.tolerations) for r in reqs]
    union: dict[tuple[object, ...], int] = {}
    for e in eligs:
        for penalty, key in e:
            union[key] = min(penalty, union.get(key, penalty))
    return _Job(spec, reqs, eligs, union, sum(r.need for r in reqs), sum(r.count for r in reqs))


def _fill_all(state: ClusterState, job: _Job, names: Sequence[str] | None, exclude: Mapping[str, Exclusion] | None
              ) -> tuple[list[GpuBinding], list[tuple[int, int]]] | None:
    """Stage every pod set; with `names`, only on those nodes in that order, else from the index."""
    stage = Stage(state, exclude)
    out: list[GpuBinding] = []
    reqs_out: list[tuple[int, int]] = []
    for req, elig in zip(job.reqs, job.eligs, strict=True):
        if not elig:
            return None
        if names is None:
            it: Iterable[str] = iter_index(state, elig, req.unit, job.spec.datasets)
        else:
            keys = {k for _, k in elig}
            it = (n for n in names if state._nodes[n].cls in keys)
        if not _fill(stage, req, it, out, reqs_out):
            return None
    return out, reqs_out


def _domain_nodes(state: ClusterState, job: _Job, level: TopologyLevel, domain: str) -> list[str]:
    names: list[str] = []
    for key in job.union:
        names.extend(state._dom_nodes.get((key, level), {}).get(domain, ()))
    return [n for n in names if state._nodes[n].ready]


def _shapes_fit(state: ClusterState, job: _Job, names: list[str]) -> bool:
    """Necessary condition, GPUs only: every pod set finds enough pod-sized pieces of free units."""
    nodes = state._nodes
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


def domain_free(state: ClusterState, keys: Iterable[tuple[object, ...]], level: TopologyLevel) -> dict[str, int]:
    totals: dict[str, int] = {}
    for key in keys:
        for d, f in state._classes[key].dom_free[level].items():
            totals[d] = totals.get(d, 0) + f
    return totals


def _best_fit_domains(state: ClusterState, job: _Job, level: TopologyLevel) -> Iterator[str]:
    """Domains with at least the gang's units free, smallest sufficient first (spread: largest first).

    One eligible class (the common case): read its per-level buckets. Several: sum their free units."""
    binpack = state.strategy == "binpack"
    if len(job.union) == 1:
        c = state._classes[next(iter(job.union))]
        order = state._dom_order[level]
        by_free = c.dom_buckets[level]
        frees = sorted((f for f in by_free if f >= job.need), reverse=not binpack)
        for f in frees:
            for r in (by_free[f] if binpack else reversed(by_free[f])):
                yield order[r]
        return
    totals = domain_free(state, job.union, level)
    ranks = state._dom_rank.get(level, {})
    sign = 1 if binpack else -1
    yield from sorted((d for d, f in totals.items() if f >= job.need),
                      key=lambda d: (sign * totals[d], ranks.get(d, 0), d))


def _in_one_domain(state: ClusterState, job: _Job, level: TopologyLevel, group_levels: list[TopologyLevel],
                   exclude: Mapping[str, Exclusion] | None) -> tuple[list[GpuBinding], list[tuple[int, int]]] | None:
    """Best-fit over the domains of `level`: the smallest free capacity that holds the gang."""
    if level is TopologyLevel.NODE:
        single = [(p, k) for k, p in sorted(job.union.items(), key=lambda kv: (kv[1], repr(kv[0])))]
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


def _everywhere_grouped(state: ClusterState, job: _Job, bottom: TopologyLevel,
                        exclude: Mapping[str, Exclusion] | None
                        ) -> tuple[list[GpuBinding], list[tuple[int, int]]] | None:
    names = []
    for key in job.union:
        c = state._classes[key]
        for b, ranks in c.buckets.items():
            if b > 0 or job.need == 0:
                names.extend(state._order[r] for r in ranks)
    levels = [TopologyLevel.BLOCK, *_levels_between(TopologyLevel.BLOCK, bottom)]
    ordered = _grouped_order(state, names, levels, job.need, job.union, job.spec.datasets)
    return _fill_all(state, job, ordered, exclude)


def _attempt(state: ClusterState, job: _Job, exclude: Mapping[str, Exclusion] | None
             ) -> tuple[list[GpuBinding], list[tuple[int, int]]] | None:
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


def _search(state: ClusterState, spec: JobSpec, reqs: list[PodReq], exclude: Mapping[str, Exclusion] | None
            ) -> tuple[list[GpuBinding], list[tuple[int, int]]] | None:
    """The whole gang, else (min_members) its first `gang_size` pods; None when neither fits."""
    got = _attempt(state, _prepare(state, spec, reqs), exclude)
    if got is None and spec.gang_size < spec.total_pods:
        got = _attempt(state, _prepare(state, spec, trim(reqs, spec.gang_size)), exclude)
    return got


def place_job(state: ClusterState, spec: JobSpec, allowed: tuple[str, ...],
              exclude: Mapping[str, Exclusion] | None = None) -> Placement | Unplaceable:
    state._ensure_index()
    reqs = resolve(spec, allowed)
    if isinstance(reqs, Unplaceable):
        return reqs
    got = _search(state, spec, reqs, exclude)
    if got is None:
        from .diagnose import diagnose

        return diagnose(state, spec, _prepare(state, spec, trim(reqs, spec.gang_size)), exclude)
    bindings, requests = got
    return build_placement(state, spec.job_id, tuple(bindings), tuple(requests))


def try_place(state: ClusterState, spec: JobSpec, reqs: list[PodReq],
              exclude: Mapping[str, Exclusion] | None = None) -> Placement | None:
    """`place_job` without the diagnosis: the same placement, or None where it would explain a refusal.

    For callers that only need to know whether (and where) the gang fits, e.g. the reservation search,
    which asks at many instants and would otherwise pay for a message it discards each time."""
    state._ensure_index()
    got = _search(state, spec, reqs, exclude)
    if got is None:
        return None
    bindings, requests = got
    return build_placement(state, spec.job_id, tuple(bindings), tuple(requests))


def _models(models: Sequence[str]) -> str:
    return "/".join(models) if models else "any GPU model"


__all__ = ["Exclusion", "PodReq", "exclusions_for", "iter_index", "place_job", "resolve", "try_place"]
