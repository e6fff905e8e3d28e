"""The preemption requests of the admission cycle: for a job that waits, whether to ask for a reclaim from the
cohort's borrowers, a within-queue preemption, a borrow-within-cohort preemption or a fair-sharing preemption,
with the candidates, and the victims this cycle's requests already count on (`Pledge`), so that two requests
never name the same victim. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.core.admission.entry import Entry
from services.core.admission.fair_sharing import fair_victims
from services.core.admission.fit import FitChecker, NoFit
from services.core.admission.lending import LendingGuard
from services.core.admission.messages import LazyText, Then
from services.core.admission.model import Reason, ReclaimRequest
from services.core.admission.quota import QueueQuota
from services.core.admission.reclaim import reclaim_candidates
from services.core.admission.state import AdmissionState
from shared.config import FairSharingStrategy, PreemptionPolicy


class Pledge:
    """What this cycle's reclaim requests in one cohort already count on."""

    __slots__ = ("demand", "first", "freed", "queue_demand", "victims")

    def __init__(self) -> None:
        self.demand: dict[str, int] = {}  # resource -> requests of the reclaiming jobs
        self.freed: dict[str, int] = {}  # resource -> usage of the victims earmarked for them
        self.queue_demand: dict[str, dict[str, int]] = {}  # queue -> resource -> its reclaiming jobs' requests
        self.first: dict[str, str] = {}  # queue -> its first reclaiming job
        self.victims: set[str] = set()

    def add(self, queue: str, job_id: str, request: Mapping[str, int]) -> None:
        self.first.setdefault(queue, job_id)
        mine = self.queue_demand.setdefault(queue, {})
        for r, n in request.items():
            self.demand[r] = self.demand.get(r, 0) + n
            mine[r] = mine.get(r, 0) + n


class PreemptionAsks:
    """One cycle's preemption requests, grouped by scope (`scope_reclaims`), and what they already count on."""

    def __init__(self, state: AdmissionState, fits: FitChecker, lending: LendingGuard,
                 lists: Mapping[str, list[Entry]]):
        self.state = state
        self.book = state.book
        self.fits = fits
        self.lending = lending
        self.lists = lists  # the cycle's pending lists per queue (priority order)
        self.scope_reclaims: dict[str, list[ReclaimRequest]] = {}
        # reclaim candidates only change when a job is admitted in the cohort
        self.cohort_version: dict[str | None, int] = {}
        self.reclaim_memo: dict[tuple[object, ...], tuple[str, ...]] = {}
        self.pledges: dict[str, Pledge] = {}  # cohort -> this cycle's reclaims
        self.preempting: dict[str, str] = {}  # queue -> its job asking for within-queue preemption this cycle
        self.lowest_own: dict[str, float] = {}  # queue -> lowest priority of its admitted preemptible jobs
        # fair-sharing preemption (opt-in, core/fair_sharing.py): replaces borrow_within_cohort, as in Kueue
        fair = state.config.fair_sharing
        self.fair_strategies = fair.preemption_strategies if fair.preemption else None
        # queue -> its first job that must borrow and found too little lendable: asked for after the admissions,
        # when what is left is known (an admission later in the cycle could take the room its victims free)
        self.fair_deferred: dict[str, tuple[QueueQuota, Entry, NoFit, dict[str, int]]] = {}

    def admitted(self, qq: QueueQuota, e: Entry) -> None:
        """`e` was admitted in `qq`: its cohort's candidates may have changed, and its queue's lowest priority."""
        if qq.pool is not None:
            self.cohort_version[qq.pool] = self.cohort_version.get(qq.pool, 0) + 1
        low = self.lowest_own.get(qq.name)
        if low is not None and e.preemptible and e.priority < low:
            self.lowest_own[qq.name] = float(e.priority)

    def ask_deferred(self) -> None:
        """Phase 5b, fair-sharing preemption, against the usage the admissions left."""
        for q in sorted(self.fair_deferred):
            assert self.fair_strategies is not None  # deferred only when fair sharing is on
            qq, e, result, request = self.fair_deferred[q]
            if e.admitted is None:
                self.fair_preempt(qq, e, result, request, self.fair_strategies)

    def lowest_preemptible(self, q: str) -> float:
        """The lowest priority among `q`'s admitted preemptible jobs (+inf when none); kept up to date by `admitted`."""
        low = self.lowest_own.get(q)
        if low is None:
            low = self.lowest_own[q] = self.state.lowest_preemptible(q)
        return low

    def fail(self, qq: QueueQuota, e: Entry, result: NoFit) -> None:
        """Record why `e` waits; if it fits its queue's nominal quota and only borrowers stand in the way,
        ask for a reclaim. Several jobs of a cohort may reclaim in one cycle: each request counts the
        earlier ones' demand and the victims already named for them (`Pledge`), so two requests never
        name the same victim and the needs add up to what the jobs really lack."""
        e.reason, e.message = result.reason, result.message
        if result.need is None or not qq.can_reclaim:
            if result.own is not None and qq.can_preempt_within:
                self.preempt_within(qq, e, result, result.own)
            if result.borrow is not None and self.preempting.get(qq.name) != e.job_id:
                if self.fair_strategies:
                    self.fair_deferred.setdefault(qq.name, (qq, e, result, result.borrow))
                else:
                    self.borrow_within(qq, e, result, result.borrow)
            return
        q, cohort = qq.name, qq.pool
        # memoised per (priority, resources needed): a deep queue fails many jobs against the same borrowers
        key = (q, e.priority, tuple(result.need), self.cohort_version.get(cohort, 0))
        candidates = self.reclaim_memo.get(key)
        if candidates is None:
            candidates = reclaim_candidates(self.state, qq, e.priority, result.need)
            self.reclaim_memo[key] = candidates
        if not candidates:
            policy = qq.reclaim_policy
            who = "lower-priority preemptible" if policy is PreemptionPolicy.LOWER_PRIORITY else "preemptible"
            e.message = self.shared_message(result, "", lambda: Then(
                result.message, f"borrowers hold the quota but none is {who} "
                f"(reclaim_within_cohort: {policy.value})"))
            result.settle(e.priority, e.reason, e.message)
            return
        assert cohort is not None  # can_reclaim: only queues in a cohort reclaim
        pledge = self.pledges.get(cohort)
        if pledge is None:
            pledge = self.pledges[cohort] = Pledge()
        request = self.fits.reclaim_need(qq, e.sig, pledge.queue_demand.get(q))
        if request is None:  # fits nominal alone, not after the jobs already reclaiming in its queue
            e.message = Then(result.message, f"waits behind this queue's reclaims ({pledge.first[q]})")
            result.settle(e.priority, e.reason, e.message)
            return
        book = self.book
        need = {}
        for r, amount in request.items():
            short = pledge.demand.get(r, 0) + amount - max(0, book.available(qq, r)) - pledge.freed.get(r, 0)
            if short > 0:
                need[r] = short
        pledge.add(q, e.job_id, request)
        e.reason = Reason.WAITING_FOR_RECLAIM
        if not need:
            self.lending.hold(qq, request, pledge.first[q])
            e.message = Then(result.message, f"fits once the capacity reclaimed for {pledge.first[q]} is freed")
            return
        free = tuple(c for c in candidates if c not in pledge.victims) if pledge.victims else candidates
        if not free:
            e.message = Then(result.message, "every reclaimable borrower is already being reclaimed")
            return
        # (all the candidates: the preemption core may take other victims for this cycle's earlier requests than
        # those earmarked for them here)
        self.lending.hold_if_coverable(qq, request, pledge.first[q], (candidates, need))
        self.scope_reclaims.setdefault(qq.scope, []).append(
            ReclaimRequest(preemptor=e.job_id, queue=q, need=need, candidates=free))
        # earmark victims in candidate order until the need is covered, so the next request names others
        freed = dict.fromkeys(need, 0)
        for victim in free:
            if all(freed[r] >= n for r, n in need.items()):
                break
            usage = self.state.admitted[victim].usage
            pledge.victims.add(victim)
            for r in need:
                got = usage.get(r, 0)
                freed[r] += got
                pledge.freed[r] = pledge.freed.get(r, 0) + got
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        e.message = Then(result.message, f"reclaim of {text} requested from {len(free)} borrowing job(s)")

    def preempt_within(self, qq: QueueQuota, e: Entry, result: NoFit, request: Mapping[str, int]) -> None:
        """Within-queue preemption (Kueue `withinClusterQueue: LowerPriority`): the job's request fits its
        queue's nominal quota but the queue's own jobs use it, so its lower-priority preemptible jobs are asked
        to make room. When the queue is under nominal on every resource it lacks and other queues borrow from
        the cohort, the same request also reclaims from them (Kueue preempts in the queue and reclaims in the
        cohort in one decision; `own_need` is then what must come from the queue itself, so that the job ends
        within nominal). One such request per queue and cycle, its first job that needs one (Kueue takes one
        head per queue and cycle); the queue's later jobs wait behind it."""
        q = qq.name
        if e.priority <= self.lowest_preemptible(q):  # nothing of its queue may make room for it
            result.settle(e.priority, e.reason, result.message)
            return
        first = self.preempting.get(q)
        pledge = self.pledges.get(qq.pool) if qq.pool is not None else None
        if first is None and pledge is not None:
            first = pledge.first.get(q)
        if first is not None:
            e.message = Then(result.message, f"waits behind this queue's preemption for {first}")
            result.settle(e.priority, e.reason, e.message)
            return
        book = self.book
        need: dict[str, int] = {}
        over: dict[str, int] = {}
        # a job that may not borrow (not preemptible, or beyond the queue's limit for borrowing without a checkpoint)
        # is admitted only within nominal: its own queue must free all it uses beyond nominal - request, not only
        # what the cohort lacks (else a borrower of its queue is preempted, borrows the freed room back, and the job
        # waits until its queue's jobs end: high-priority jobs waited days on Philly)
        limit = qq.unsafe_borrow_limit
        within_nominal = not e.preemptible or (limit is not None and e.unsaved_runtime_s > limit)
        for r, amount in request.items():
            short = amount - max(0, book.available(qq, r))
            if within_nominal:
                short = max(short, book.used(q, r) + amount - qq.nominal[r])
            if short > 0:
                need[r] = short
                over[r] = max(0, book.used(q, r) + amount - qq.nominal[r])
        if not need:
            return
        version = self.fits.scope_version.get(qq.scope, 0)
        own = self.state.own_candidates(qq, e.priority, need)  # kept across cycles while its queue's jobs stay
        borrowers: tuple[str, ...] = ()
        found: tuple[str, ...] = ()
        if qq.can_reclaim and all(book.used(q, r) < qq.nominal[r] for r in need):
            key = ("cohort", q, e.priority, tuple(need), version)
            hit = self.reclaim_memo.get(key)
            if hit is None:
                hit = self.reclaim_memo[key] = reclaim_candidates(self.state, qq, e.priority, need)
            found = hit
            taken = pledge.victims if pledge is not None else set()
            borrowers = tuple(c for c in found if c not in taken)
        own_need = {r: min(n, over[r]) for r, n in need.items() if min(n, over[r]) > 0} if borrowers else need
        if not own:
            result.settle(e.priority, e.reason, result.message)  # nothing of its queue may make room this cycle
            return
        self.preempting[q] = e.job_id
        self.lending.hold_if_coverable(qq, request, e.job_id, (own, own_need), (found + own, need))
        if borrowers:
            assert qq.pool is not None  # can_reclaim: only queues in a cohort reclaim
            pledge = self.pledges.setdefault(qq.pool, Pledge())
            pledge.first.setdefault(q, e.job_id)
            pledge.victims.update(borrowers)
        reason = Reason.RECLAIM_QUOTA if borrowers else Reason.PRIORITY_PREEMPTION
        self.scope_reclaims.setdefault(qq.scope, []).append(ReclaimRequest(
            preemptor=e.job_id, queue=q, need=need, candidates=borrowers + own, reason=reason, own_need=own_need))
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        also = f" and reclaim from {len(borrowers)} borrowing job(s)" if borrowers else ""
        e.reason = Reason.WAITING_FOR_RECLAIM if borrowers else Reason.WAITING_FOR_PREEMPTION
        e.message = Then(result.message, f"preemption of {text} requested from {len(own)} lower-priority "
                          f"job(s) of queue {q}{also} (within_queue: {qq.config.preemption.within_queue.value})")

    def borrow_within(self, qq: QueueQuota, e: Entry, result: NoFit, request: Mapping[str, int]) -> None:
        """Kueue `borrowWithinCohort` (KEP-1337): a job that must borrow, and finds too little lendable in its
        cohort, may preempt other queues' borrowers of strictly lower priority, at most the queue's
        `max_priority_threshold`, to get the room it borrows. Such victims, requeued, cannot take it back (lower
        priority). One such request per queue and cycle, like within-queue preemption."""
        q, cohort = qq.name, qq.pool
        assert cohort is not None and qq.borrow_threshold is not None  # set only for queues that can reclaim
        pledge = self.pledges.setdefault(cohort, Pledge())
        first = self.preempting.get(q) or pledge.first.get(q)
        if first is not None:
            e.message = Then(result.message, f"waits behind this queue's preemption for {first}")
            result.settle(e.priority, e.reason, e.message)
            return
        book = self.book
        need = {r: n - max(0, book.available(qq, r)) for r, n in request.items()
                if n - max(0, book.available(qq, r)) > 0}
        if not need:
            return
        limit = min(qq.borrow_threshold, e.priority - 1)
        found = reclaim_candidates(self.state, qq, e.priority, need)
        below = tuple(c for c in found if (self.state.priority(c) or 0) <= limit)
        candidates = tuple(c for c in below if c not in pledge.victims)
        if not candidates:
            result.settle(e.priority, e.reason, result.message)
            return
        self.preempting[q] = e.job_id
        self.lending.hold_if_coverable(qq, request, e.job_id, (below, need))
        pledge.first.setdefault(q, e.job_id)
        pledge.victims.update(candidates)
        threshold = None if qq.borrow_threshold == float("inf") else int(qq.borrow_threshold)
        self.scope_reclaims.setdefault(qq.scope, []).append(ReclaimRequest(
            preemptor=e.job_id, queue=q, need=need, candidates=candidates,
            max_victim_priority=int(limit) if threshold is not None else e.priority - 1))
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        e.reason = Reason.WAITING_FOR_RECLAIM
        e.message = Then(result.message, f"preemption of {text} requested from {len(candidates)} lower-priority "
                          "borrowing job(s) in order to borrow (borrow_within_cohort)")

    def fair_preempt(self, qq: QueueQuota, e: Entry, result: NoFit, request: Mapping[str, int],
                      strategies: tuple[FairSharingStrategy, ...]) -> None:
        """Fair-sharing preemption (core/fair_sharing.py): a job that must borrow and finds too little lendable
        asks other queues' borrowers to make room when the strategies say its queue's share, with it admitted,
        is not above theirs. One such request per queue and cycle, like within-queue preemption."""
        q, pool = qq.name, qq.pool
        assert pool is not None  # only queues in a cohort borrow
        pledge = self.pledges.setdefault(pool, Pledge())
        first = self.preempting.get(q) or pledge.first.get(q)
        if first is not None:
            e.message = Then(result.message, f"waits behind this queue's preemption for {first}")
            return
        book = self.book
        need = {r: n - max(0, book.available(qq, r)) for r, n in request.items()
                if n - max(0, book.available(qq, r)) > 0}
        if not need:
            return
        found = reclaim_candidates(self.state, qq, e.priority, need)
        # not above the preemptor's priority (even under `Any`): the admission order puts priority before the
        # fair share, so a higher-priority victim would take its room back at the next cycle
        free = [c for c in found if c not in pledge.victims and (self.state.priority(c) or 0) <= e.priority]
        victims = fair_victims(self.state, qq, request, free, strategies, self.comeback(e.priority, free)) \
            if free else ()
        if not victims:
            e.message = Then(result.message, "no borrower is above this queue's fair share with the job admitted "
                              "by enough to keep the room it would free "
                              f"(fair_sharing: {', '.join(s.value for s in strategies)})")
            return
        self.preempting[q] = e.job_id
        pledge.first.setdefault(q, e.job_id)
        pledge.victims.update(victims)
        # max_victim_priority: the preemption core holds it to the same bound (the preemptor borrows)
        self.scope_reclaims.setdefault(qq.scope, []).append(ReclaimRequest(
            preemptor=e.job_id, queue=q, need=need, candidates=victims, max_victim_priority=e.priority))
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        e.reason = Reason.WAITING_FOR_RECLAIM
        e.message = Then(result.message, f"preemption of {text} requested from {len(victims)} job(s) of queues "
                          "above their fair share (fair_sharing)")

    def comeback(self, priority: int, candidates: list[str]) -> dict[str, list[dict[str, int]]]:
        """Per queue of the candidates, the requests (first option per pod set) of its pending jobs of
        `priority`: what it would admit into room its victims free, in the admission order by share, before a
        preemptor of that priority whose standing is not below (fair_sharing.fair_victims keeps it behind).
        Lower-priority jobs come after the preemptor whatever their share, higher-priority ones before it
        whatever the preemption does."""
        found: dict[str, list[dict[str, int]]] = {}
        for q in sorted({self.state.admitted[c].spec.queue for c in candidates}):
            qq = self.book.queues.get(q)
            if qq is None:
                continue
            seen: set[int] = set()
            usages = found[q] = []
            for e in self.lists.get(q, ()):
                if e.priority != priority or e.admitted is not None or e.verdict is not None or e.sid in seen:
                    continue
                seen.add(e.sid)
                request = self.fits.first_request(qq, e.sig)
                if request:
                    usages.append(request)
        return found

    @staticmethod
    def shared_message(result: NoFit, variant: str, build: Callable[[], LazyText]) -> LazyText:
        """Messages shared by every job that failed the same way (one string, not one per job); kept on
        the memoised result itself so it dies with it."""
        if result.variants is None:
            result.variants = {}
        msg = result.variants.get(variant)
        if msg is None:
            msg = result.variants[variant] = build()
        return msg
