"""Victim selection: the least-lost-work set of eligible jobs whose release makes the preemptor placeable.

1 filter     every running job through `policy.victim_verdicts` (`victim_verdict`'s rules, once per queue; reasons kept)
2 tiers      borrowers of other queues first, then the preemptor's own queue (reclaim takes from
             borrowers first; ReclaimQuota only from borrowers): a later tier is tried only when the
             earlier ones together are not sufficient. A reclaim first tries the borrowers that would lose
             no more than `max_victim_loss_s` (the bound steers a reclaim, never vetoes it)
3 choose     sufficient = the placement core places the preemptor on a what-if copy with the victims
             released (`ClusterState.fits_if_released`, the live state untouched) and, for a request of
             admission (ReclaimQuota, or within-queue preemption), the victims free at least `need` of every
             quota resource and `own_need` of it from the preemptor's own queue, and no borrowing queue is taken
             below its nominal quota by more than its last victim (Kueue picks a victim only while its
             queue still borrows).
             Among sufficient sets: least lost GPU-seconds, then lowest priority, then most recently
             started, then job ids. Small pools are searched exactly (subsets in that order); large pools
             greedily in candidate order (least lost work, lowest priority, newest, id) as Kueue does.
4 minimise   walk the picks in reverse and drop every victim whose removal keeps the set sufficient
             (Kueue preemption.go: greedy then reverse minimisation)

Gangs are preempted whole: a victim is a job and releasing it frees every pod of its gang.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

from services.core.scheduler import ClusterState, may_fit_if_released
from shared.config import QueuesConfig

from .model import RECLAIM, Preemptor, RunningJob, Selection, Why, by_job_id, summed_usage
from .policy import exceeds_loss_bound, needed_resources, victim_verdicts

EXACT_POOL = 8  # pools up to this size are searched exhaustively (2^8 subsets, most pruned cheaply)
MAX_FITS_CHECKS = 512


def candidate_key(job: RunningJob, now: float) -> tuple[float, int, float, str]:
    return (job.lost_gpu_seconds(now), job.priority, -job.started_at, job.job_id)


def set_key(jobs: Sequence[RunningJob], now: float) -> tuple[object, ...]:
    """Order of victim sets: least lost work, lowest priorities, most recently started, fewest, ids."""
    return (round(sum(j.lost_gpu_seconds(now) for j in jobs), 6),
            max((j.priority for j in jobs), default=0), sum(j.priority for j in jobs),
            -min((j.started_at for j in jobs), default=0.0), len(jobs), tuple(sorted(j.job_id for j in jobs)))


class _Checker:
    """Sufficiency of a victim set, memoised, counting the what-if placements it costs."""

    def __init__(self, preemptor: Preemptor, cluster: ClusterState, usage: Mapping[str, Mapping[str, int]],
                 config: QueuesConfig):
        self.p = preemptor
        self.cluster = cluster
        self.usage = usage
        self.config = config
        self.memo: dict[frozenset[str], bool] = {}
        self.checks = 0

    def need_ok(self, jobs: Sequence[RunningJob]) -> bool:
        if self.p.for_quota:
            for r, amount in sorted(self.p.need.items()):
                freed = sum(j.usage.get(r, 0) for j in jobs)
                if freed < amount:
                    return False
            for r, amount in sorted(self.p.own_need.items()):
                freed = sum(j.usage.get(r, 0) for j in jobs if j.queue == self.p.queue)
                if freed < amount:
                    return False
        return True

    def guarantees_ok(self, jobs: Sequence[RunningJob]) -> bool:
        # No borrower may end more than one victim below its nominal quota (each pick while it borrows).
        by_queue: dict[str, list[RunningJob]] = {}
        for j in jobs:
            if j.queue != self.p.queue:
                by_queue.setdefault(j.queue, []).append(j)
        for q, taken in sorted(by_queue.items()):
            qc = self.config.queue_map.get(q)
            if qc is None:
                continue
            held = {r for j in taken for r in j.usage}
            if self.p.for_quota:  # a reclaim: measured on what it needs (Kueue), so a queue borrowing CPU while
                held &= set(self.p.need) | set(self.p.own_need)  # within its GPU quota gives the CPU back
            for r in sorted(held):
                used = self.usage.get(q, {}).get(r, 0)
                nominal = qc.quotas[r].nominal if r in qc.quotas else 0
                amounts = [j.usage.get(r, 0) for j in taken if j.usage.get(r, 0) > 0]
                if amounts and used - (sum(amounts) - min(amounts)) <= nominal:
                    return False
        return True

    def fits(self, jobs: Sequence[RunningJob], *, guarantees: bool = True) -> bool:
        """Sufficient set. `guarantees=False` gives the necessary condition used to prune a whole pool."""
        key = frozenset(j.job_id for j in jobs)
        if guarantees and key in self.memo:
            return self.memo[key]
        ok = self.need_ok(jobs) and (not guarantees or self.guarantees_ok(jobs))
        if ok:
            self.checks += 1
            # only whether it fits is read: a count of the pods that would fit answers, far cheaper than releasing
            # the victims on a copy and placing, unless several pod sets must start; then the placement (without
            # the diagnosis of a refusal) does
            spec, allowed = self.p.spec, self.p.allowed_models
            counted = may_fit_if_released(self.cluster, spec, allowed, key)
            if counted is None:
                counted = self.cluster.try_place_if_released(spec, key, allowed or None) is not None
            ok = counted
        if guarantees:
            self.memo[key] = ok
        return ok


def _minimise(picks: list[RunningJob], check: _Checker) -> list[RunningJob]:
    kept = list(picks)
    for job in reversed(picks):
        trial = [j for j in kept if j.job_id != job.job_id]
        if trial and check.fits(trial):
            kept = trial
    return kept


def _greedy(pool: Sequence[RunningJob], check: _Checker) -> list[RunningJob] | None:
    picks: list[RunningJob] = []
    for job in pool:
        if not check.guarantees_ok([*picks, job]):
            continue  # its queue no longer borrows once the earlier picks are gone (Kueue does the same)
        picks.append(job)
        if check.fits(picks):
            return _minimise(picks, check)
    return None


def _exact(pool: Sequence[RunningJob], check: _Checker, now: float) -> list[RunningJob] | None:
    subsets = [list(c) for k in range(1, len(pool) + 1) for c in combinations(pool, k)]
    subsets.sort(key=lambda s: set_key(s, now))
    for s in subsets:
        if check.checks >= MAX_FITS_CHECKS:
            return None
        if check.fits(s):
            return _minimise(s, check)
    return None


def _cheaper_soon(preemptor: Preemptor, chosen: Sequence[RunningJob], ordered: Sequence[RunningJob],
                  rejected: Mapping[str, str], pool: Sequence[RunningJob], check: _Checker, config: QueuesConfig,
                  now: float) -> bool:
    """A reclaim of nominal quota whose victims would lose more than `max_victim_loss_s` (a borrower that cannot
    checkpoint, running long) waits instead when borrowers within the bound, still in their protection window,
    would be enough with the chosen tier's others, and every one of them leaves its window before the lender's
    deadline (`waiting_since` + the window: the guarantee's bound without the grace). They were protected only
    by their youth (rejected `ProtectedJustStarted`, after the class, queue and priority rules); the request is
    decided again when the first leaves it (`protection_ends`). Issue 49: on Philly October such reclaims threw
    away days of 8-GPU runs for a 1-GPU lender while checkpointing borrowers were minutes from eligible."""
    since, window = preemptor.waiting_since, config.policy.protection_window_s
    if (not config.policy.loss_aware_reclaim or since is None or preemptor.reason != RECLAIM
            or preemptor.max_victim_priority is not None
            or not any(exceeds_loss_bound(j, config, now) for j in chosen)):
        return False
    young = [j for j in ordered if rejected.get(j.job_id) == Why.JUST_STARTED
             and j.started_at <= since and not exceeds_loss_bound(j, config, j.started_at + window)]
    if not young:
        return False
    cheap = sorted([j for j in pool if not exceeds_loss_bound(j, config, now)] + young,
                   key=lambda j: candidate_key(j, now))
    return check.fits(cheap, guarantees=False) and _greedy(cheap, check) is not None


def select_victims(preemptor: Preemptor, running: Sequence[RunningJob], cluster: ClusterState,
                   config: QueuesConfig, now: float, *, busy: Iterable[str] = (),
                   exact_pool: int = EXACT_POOL, usage: Mapping[str, Mapping[str, int]] | None = None
                   ) -> Selection:
    """Choose victims for `preemptor`. `busy`: jobs already in a preemption protocol (never chosen twice).
    `usage`: `usage_by_queue(running)`, when the caller keeps it (else it is summed here).

    `cluster` is only queried (what-if copies); the caller acts on the returned selection."""
    ordered = sorted(running, key=by_job_id)
    if usage is None:
        usage = summed_usage(ordered)
    rejected, eligible = victim_verdicts(preemptor, ordered, config, usage, now, set(busy))
    check = _Checker(preemptor, cluster, usage, config)
    if not preemptor.for_quota and cluster.try_place(preemptor.spec, preemptor.allowed_models or None) is not None:
        return Selection((), 0.0, "FitsWithoutPreemption", "the preemptor fits without taking anything",
                         rejected, 1)
    borrowers = [j for j in eligible if j.queue != preemptor.queue]
    own = [j for j in eligible if j.queue == preemptor.queue]
    tiers = [borrowers, borrowers + own] if borrowers and own else [eligible]
    if preemptor.reason == RECLAIM:
        # the unsaved-work bound never vetoes a reclaim, but it steers it: borrowers within the bound first
        safe = [j for j in borrowers if not exceeds_loss_bound(j, config, now)]
        if safe and len(safe) < len(borrowers):
            tiers.insert(0, safe)
    for pool in tiers:
        pool = sorted(pool, key=lambda j: candidate_key(j, now))
        if not pool or not check.fits(pool, guarantees=False):
            continue
        chosen = _exact(pool, check, now) if len(pool) <= exact_pool else None
        if chosen is None:
            chosen = _greedy(pool, check)
        if chosen is not None:
            if _cheaper_soon(preemptor, chosen, ordered, rejected, pool, check, config, now):
                return Selection((), 0.0, "WaitingForCheaperVictims",
                                 f"the reclaim for {preemptor.job_id} would throw away more than "
                                 f"{config.policy.max_victim_loss_s}s of a borrower's run; borrowers that lose "
                                 "less leave their protection window in time", rejected, check.checks)
            chosen.sort(key=lambda j: candidate_key(j, now))
            return Selection(tuple(j.job_id for j in chosen), sum(j.lost_gpu_seconds(now) for j in chosen),
                             rejected=rejected, fits_checks=check.checks)
    resources = ", ".join(needed_resources(preemptor)) or "GPUs"
    if not eligible:
        return Selection((), 0.0, "NoCandidates",
                         f"no running job may be preempted for {preemptor.job_id} ({len(rejected)} protected "
                         "or not eligible)", rejected, check.checks)
    return Selection((), 0.0, "InsufficientVictims",
                     f"even all {len(eligible)} eligible jobs would not free enough {resources} for "
                     f"{preemptor.job_id}", rejected, check.checks)
