"""Flavor assignment for the admission cycle: whether a job fits its queue now, on which flavors, and if not
why (the reason now, the numbers when read), memoised per queue and request until an admission in its scope (or,
with a capacity cap, anywhere) retires the memo. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.core.admission.entry import Entry
from services.core.admission.messages import LazyText, Then, Why
from services.core.admission.model import Reason
from services.core.admission.quota import QueueQuota
from services.core.admission.resources import GpuOption, PodSetDemand, Signature, gpu_capped
from services.core.admission.state import AdmissionState
from shared.config import FairSharingStrategy, PoolFungibility, PoolStep

# Why a job may not borrow, and the fit memo's key for it (`fit_key`): the memoised verdict's message says why.
NO_CHECKPOINT = "no-checkpoint"  # it cannot checkpoint and may run longer than the queue lets such jobs borrow
NOT_PREEMPTIBLE = "not-preemptible"  # nobody could take a loan back from it: it never borrows
KEY_SPAN = 1 << 40  # above any request id (`Entry.sid`): the key's quotient says why, its remainder which request
NO_LOAN = {-1: NO_CHECKPOINT, -2: NOT_PREEMPTIBLE}


def fit_key(e: Entry, limit: int | None, sid: int | None = None) -> int:
    """The fit memo's key of `e`: its request (`sid`) when it may borrow, else negative, one range per reason it
    may not (`NO_LOAN`), so that jobs of one request but different reasons never share a verdict. `sid`: the request
    on one of its node pools (`Entry.pools`) instead of its own."""
    if sid is None:
        sid = e.sid
    if not e.preemptible:
        return -2 * KEY_SPAN + sid
    if limit is not None and e.unsaved_runtime_s > limit:
        return -KEY_SPAN + sid
    return sid


class Fit:
    __slots__ = ("borrowing", "choice", "share", "usage", "usage_id", "version")

    def __init__(self, choice: tuple[GpuOption, ...], usage: dict[str, int], borrowing: bool):
        self.choice = choice
        self.usage = usage
        self.borrowing = borrowing
        self.version = -1  # the memo version it was computed at (the memo stores results, not tuples)
        self.usage_id: int | None = None  # set by the lending-refusal memo when first needed
        # the queue's fair share after admitting `usage` (`FitChecker.key`), set when first needed: it reads the queue's
        # usage, which only an admission in its scope changes, and that retires this fit (a new memo version)
        self.share: float | None = None


class NoFit:
    # few objects per failed check: each one lives to the cycle's end, so the collector promotes it, and
    # enough promotions per cycle trigger a full collection over the whole backlog
    __slots__ = ("borrow", "message", "need", "own", "reason", "settled", "variants", "version")

    def __init__(self, reason: str, message: str | LazyText, need: dict[str, int] | None,
                 own: dict[str, int] | None = None, borrow: dict[str, int] | None = None):
        self.reason = reason
        self.message = message
        self.variants: dict[str, LazyText] | None = None  # created when first needed
        self.need = need  # set when the job fits its nominal quota and only borrowers stand in the way
        # set when the job's request fits its queue's nominal quota but its queue's own jobs use it: what
        # within-queue preemption (with, under nominal, a reclaim in the same decision) would have to make room for
        self.own = own
        self.borrow = borrow  # set when it must borrow and the cohort lends too little: its request
        # priority -> (reason, message) once PreemptionAsks.fail found that every later job of that priority
        # failing this way ends the same (no reclaim candidates; or behind this queue's reclaims, which only grow
        # in a cycle): the scan then skips `fail` for them
        self.settled: dict[int, tuple[str, str | LazyText]] | None = None
        self.version = -1

    def settle(self, priority: int, reason: str, message: str | LazyText) -> None:
        if self.settled is None:
            self.settled = {}
        self.settled[priority] = (reason, message)


class FitChecker:
    """One cycle's fit checks: the memo of results per queue and request, the versions that retire it, and the
    free capacity left (when the cycle was given one), which each admission charges (`charge`)."""

    def __init__(self, state: AdmissionState, capacity: Mapping[str, int] | None,
                 fair_strategies: tuple[FairSharingStrategy, ...] | None):
        self.state = state
        self.book = state.book
        self.cap_left = dict(capacity) if capacity is not None else None
        # asked only whether fair-sharing preemption is on (a job that must borrow then records its request)
        self.fair_strategies = fair_strategies
        # Memoised fit checks are valid while nothing they read changes: an admission changes its cohort's
        # pool (or, without cohort, only its queue), and with `capacity` the free GPUs every queue reads.
        self.version = 0  # admissions so far
        self.scope_version: dict[str, int] = {}
        self.memo: dict[str, dict[int, Fit | NoFit]] = {}  # queue -> sid -> result (with its version)
        # job -> the node pool its last evaluation chose (only jobs whose queue lists `pools`: Entry.pools)
        self.chosen_pool: dict[str, str] = {}

    def charge(self, qq: QueueQuota, usage: Mapping[str, int]) -> None:
        """An admission in `qq` took `usage`: less free capacity, and every memoised check it could change retires."""
        cap = self.cap_left
        if cap is not None:
            for r, amount in usage.items():
                if gpu_capped(cap, r):
                    cap[r] = cap.get(r, 0) - amount
        self.version += 1
        self.scope_version[qq.scope] = self.scope_version.get(qq.scope, 0) + 1

    def version_of(self, qq: QueueQuota) -> int:
        return self.version if self.cap_left is not None else self.scope_version.get(qq.scope, 0)

    def evaluate(self, qq: QueueQuota, e: Entry, sid: int | None = None, sig: Signature | None = None
                 ) -> Fit | NoFit:
        """Whether `e` fits now (its request `sig`/`sid` on one node pool when given). A job whose queue lists node
        pools and that selects none is judged on each pool (`choose_pool`)."""
        if sig is None and e.pools:
            return self.choose_pool(qq, e)
        memo = self.memo.get(qq.name)
        if memo is None:
            memo = self.memo[qq.name] = {}
        key = fit_key(e, qq.unsafe_borrow_limit, sid)
        hit = memo.get(key)
        version = self.version_of(qq)
        if hit is not None and hit.version == version:
            return hit
        result = self.assign(qq, e.sig if sig is None else sig, NO_LOAN.get(key // KEY_SPAN) if key < 0 else None)
        result.version = version
        memo[key] = result
        return result

    def choose_pool(self, qq: QueueQuota, e: Entry) -> Fit | NoFit:
        """Node pools as flavors (docs/admission.md): the queue's `pools` in order, Kueue's flavor fungibility.
        A pool that fits without borrowing is taken; one that fits by borrowing is taken at once under
        `when_can_borrow: Borrow`, else only when no later pool fits without; a pool where preempting others could
        make room is waited on at once under `when_can_preempt: Preempt` (unless a pool fitting by borrowing came
        first), else only when no pool fits; failing all, the first pool whose nominal quota holds the job once the
        queue's running jobs end, else the first. Records the pool (`chosen_pool`); a waiting job's message names
        it."""
        policy = qq.config.pool_fungibility or PoolFungibility()
        borrow_now = policy.when_can_borrow is PoolStep.BORROW
        preempt_now = policy.when_can_preempt is PoolStep.PREEMPT
        borrowing: tuple[str, Fit] | None = None
        preempting: tuple[str, NoFit] | None = None
        later: tuple[str, NoFit] | None = None
        failed: tuple[str, NoFit] | None = None
        chosen: tuple[str, Fit | NoFit] | None = None
        for pool, sig, sid in e.pools:
            result = self.evaluate(qq, e, sid, sig)
            if isinstance(result, Fit):
                if not result.borrowing or borrow_now:
                    chosen = pool, result
                    break
                borrowing = borrowing or (pool, result)
                continue
            if self.victims_possible(qq, e, result):
                if preempt_now and borrowing is None:
                    chosen = pool, result
                    break
                preempting = preempting or (pool, result)
            elif result.own is not None:  # its nominal quota holds it once the queue's running jobs end
                later = later or (pool, result)
            failed = failed or (pool, result)
        chosen = chosen or borrowing or preempting or later or failed
        assert chosen is not None  # e.pools is not empty
        pool, result = chosen
        self.chosen_pool[e.job_id] = pool
        if isinstance(result, Fit):
            return result
        # the memoised verdict is shared with jobs judged on other pools (or none): this job's message names its own
        out = NoFit(result.reason, Then(result.message, f"on node pool {pool} (queue {qq.name} tries pools "
                                                         f"{', '.join(p for p, _s, _i in e.pools)} in that order)"),
                    result.need, result.own, result.borrow)
        out.version = result.version
        return out

    def assign(self, qq: QueueQuota, sig: Signature, no_loan: str | None = None) -> Fit | NoFit:
        """Flavor assignment: per pod set, the first option that fits without borrowing, else the first that
        fits by borrowing (Kueue's 'prefer a fit without borrowing'), within the free capacity if given.
        `no_loan` set (why the job may not borrow: `NOT_PREEMPTIBLE`, or `NO_CHECKPOINT` for a job that cannot
        checkpoint, over its queue's runtime limit for such borrowing): only fits within nominal quota count."""
        may_borrow = no_loan is None
        book = self.book
        used = book.usage[qq.name]
        cap = self.cap_left
        taken: dict[str, int] = {}
        choice: list[GpuOption] = []
        borrowing = False
        for demand in sig:
            options = self.state.options(qq, demand)
            if not options:  # config changed under a pending job; its verdict says so, this is a guard
                return NoFit(Reason.NO_FLAVOR, f"queue {qq.name} has no quota for this request", None)
            best: GpuOption | None = None
            best_borrows = False
            for opt in options:
                r = opt[1]
                total = taken.get(r, 0) + opt[2]
                if total > book.available(qq, r):
                    continue
                if cap is not None and total > cap.get(r, 0) and gpu_capped(cap, r):
                    continue
                borrows = used.get(r, 0) + total > qq.nominal[r]
                if not borrows:
                    best, best_borrows = opt, False
                    break
                if best is None and may_borrow:
                    best, best_borrows = opt, True
            if best is None:
                return self.why_not(qq, sig, demand, options, taken, no_loan)
            choice.append(best)
            taken[best[1]] = taken.get(best[1], 0) + best[2]
            borrowing = borrowing or best_borrows
        return Fit(tuple(choice), taken, borrowing)

    def victims_possible(self, qq: QueueQuota, e: Entry, result: NoFit) -> bool:
        """Whether preempting others could make room for `e` where it failed: borrowers to reclaim from (`need`,
        `borrow`), or its own queue's preemptible jobs of lower priority where it fits the nominal quota (`own`)."""
        if result.need is not None or result.borrow is not None:
            return True
        return result.own is not None and any(o.preemptible and o.priority < e.priority
                                              for o in self.state.admitted_entries(qq.name))

    def key(self, qq: QueueQuota, e: Entry, fit: Fit) -> tuple[int, float, float, str]:
        # e.order[1]: the submit time, or the duration-aware order time when a prediction was given
        # plus the queue's historic borrowing when the caller gave usage history (core/history.py)
        share = fit.share
        if share is None:
            share = fit.share = self.book.share(qq, fit.usage)
        return (-e.priority, share + self.state.history_share(qq.name), e.order[1], e.job_id)

    def why_not(self, qq: QueueQuota, sig: Signature, demand: PodSetDemand, options: tuple[GpuOption, ...],
                 taken: Mapping[str, int], no_loan: str | None = None) -> NoFit:
        """Why pod set `demand` fits none of its options: the reason now, the message (numbers from every
        option) only when someone reads it (`Why`); reasons follow the first (preferred) option."""
        book = self.book
        q = qq.name
        cap = self.cap_left
        capacity_only = cap is not None and any(
            taken.get(r, 0) + amount <= book.available(qq, r) and gpu_capped(cap, r)
            for _m, r, amount in options)
        message = Why(book, qq, options, taken, cap)  # `taken` is this check's own, never changed again
        if capacity_only:
            return NoFit(Reason.WAITING_FOR_CAPACITY, message, None)
        _m, r, amount = options[0]
        total = taken.get(r, 0) + amount
        used, nominal = book.used(q, r), qq.nominal[r]
        if used + total <= nominal and qq.cohort is not None:
            return NoFit(Reason.WAITING_FOR_QUOTA, message, self.reclaim_need(qq, sig))  # set: may reclaim
        own = self.nominal_request(qq, sig) if qq.can_preempt_within else None
        if qq.cohort is None:
            return NoFit(Reason.WAITING_FOR_QUOTA, message, None, own)
        if no_loan is not None and any(taken.get(r2, 0) + n <= book.available(qq, r2) for _m2, r2, n in options):
            if no_loan == NOT_PREEMPTIBLE:
                # a loan nobody could take back would keep the lender from its own quota for as long as it runs
                return NoFit(Reason.WAITING_FOR_QUOTA, Then(
                    message, "it is not preemptible, so it never borrows: it waits for its queue's nominal "
                    f"quota (queue {q})"), None, own)
            # it would fit by borrowing, but the risk of borrowing without a checkpoint is refused
            return NoFit(Reason.WAITING_FOR_QUOTA, Then(
                message, f"it cannot checkpoint and may run longer than the "
                f"{qq.unsafe_borrow_limit}s queue {q} allows such jobs to borrow for "
                "(max_borrow_runtime_without_checkpoint_s)"), None, own)
        limit = qq.borrowing_limit[r]
        if limit is not None and used + total > nominal + limit:
            return NoFit(Reason.WAITING_FOR_QUOTA, message, None, own)
        borrow = (self.first_request(qq, sig)
                  if qq.borrow_threshold is not None or (self.fair_strategies and qq.can_reclaim) else None)
        return NoFit(Reason.WAITING_FOR_BORROWABLE_QUOTA, message, None, own, borrow)

    def first_request(self, qq: QueueQuota, sig: Signature) -> dict[str, int]:
        """The request per resource with each pod set's preferred (first) option."""
        taken: dict[str, int] = {}
        for demand in sig:
            options = self.state.options(qq, demand)
            if options:
                _m, r, amount = options[0]
                taken[r] = taken.get(r, 0) + amount
        return dict(sorted(taken.items()))

    def nominal_request(self, qq: QueueQuota, sig: Signature) -> dict[str, int] | None:
        """The request per resource if the whole job fits the queue's nominal quota once the queue's own jobs
        make room (first such flavor per pod set), else None."""
        taken: dict[str, int] = {}
        for demand in sig:
            for _m, r, amount in self.state.options(qq, demand):
                if taken.get(r, 0) + amount <= qq.nominal[r]:
                    taken[r] = taken.get(r, 0) + amount
                    break
            else:
                return None
        return dict(sorted(taken.items())) if taken else None

    def reclaim_need(self, qq: QueueQuota, sig: Signature,
                      pledged: Mapping[str, int] | None = None) -> dict[str, int] | None:
        """If the whole job fits the queue's nominal quota (first such flavor per pod set), the request per
        resource; None if it does not fit nominal. `pledged`: this queue's earlier reclaiming jobs this cycle,
        counted as if already admitted."""
        used = self.book.usage[qq.name]
        pledged = pledged or {}
        taken: dict[str, int] = {}
        for demand in sig:
            for _m, r, amount in self.state.options(qq, demand):
                if used.get(r, 0) + pledged.get(r, 0) + taken.get(r, 0) + amount <= qq.nominal[r]:
                    taken[r] = taken.get(r, 0) + amount
                    break
            else:
                return None
        return dict(sorted(taken.items()))
