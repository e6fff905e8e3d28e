"""One admission cycle, in Kueue's named phases (pkg/scheduler/scheduler.go `schedule()`), but admitting as
many jobs per cycle as fit instead of one head per queue:

  1 heads     per queue, the pending jobs in order (priority, then submit time, then id)
  2 snapshot  the live QuotaBook plus this cycle's copy of free physical capacity
  3a-5a       phases 3-5 over only the jobs that fit their queue's nominal quota without borrowing (Kueue's
              entry ordering: entries that do not borrow come first), then phases 3-5 over everything
  3 nominate  per queue, the next job that fits (flavor assignment); jobs before it get their reason now
  4 order     a heap of the nominated heads: priority, then dominant resource share / weight after admission
              (Kueue fair_sharing.go), then submit time, then job id
  5 admit     pop the best head, re-check it (usage only grows within a cycle, so a head can stop fitting
              but a job that failed never starts fitting), charge it, nominate that queue's next job
  6 requeue   everything left pending gets a reason, a message with the numbers and its positions

Why scanning ahead is sound: availability only shrinks while a cycle admits, so a job that does not fit when
its queue is scanned would not fit at its turn either. The heap then only ever holds one fitting job per
queue, so a cycle costs O(pending) cheap memoised checks plus O(admitted · log queues) heap work.

Why unchanged cohorts are skipped: without `capacity` and `max_admissions`, cohorts (and queues without one)
share nothing, so a cohort where nothing changed since a cycle that admitted nothing there would decide the
same again; its statuses and reclaims are reused from that cycle. Event-driven cycles then cost
O(pending in the changed cohorts). A hypothesis test checks the result against a cycle with caches dropped.

The cycle composes one collaborator per concern: FitChecker (fit.py: flavor assignment and its memo), LendingGuard
(lending.py: lending refusals and held room), PreemptionAsks (reclaim_requests.py: reclaims and preemptions for
jobs that wait) and ScopeReuse (reuse.py: unchanged scopes and sealed queues). It keeps the phases themselves.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from services.core.admission.entry import Entry
from services.core.admission.fit import Fit, FitChecker, fit_key
from services.core.admission.lending import LendingGuard
from services.core.admission.model import AdmissionDecision, AdmittedWorkload, Reason
from services.core.admission.quota import QueueQuota
from services.core.admission.reclaim_requests import PreemptionAsks
from services.core.admission.resources import with_pool
from services.core.admission.reuse import ScopeReuse
from services.core.admission.state import AdmissionState
from services.core.admission.statuses import PendingStatuses
from shared.config import StopPolicy


def admission_cycle(state: AdmissionState, now: float, *, capacity: Mapping[str, int] | None = None,
                    max_admissions: int | None = None, explain: bool = True) -> AdmissionDecision:
    """Admit what fits, in order, and explain everything that still waits. Applies the admissions to `state`.

    `capacity`: free physical GPUs per model, an extra cap so admission does not admit more than the cluster
    could hold; a model missing from it has none free. MIG slices ("<model>:<profile>") are capped only when
    their key is present (free whole GPUs say nothing about free slices; placement decides).
    `max_admissions`: stop after that many admissions (the rest wait for the next cycle).
    `decision.pending` is a PendingStatuses view, computed when read and valid until the state changes.
    `explain=False` leaves it empty (not even the lists are copied) for callers that only need the admissions,
    such as the simulator or the ETA forward simulation; admissions and reclaims are identical either way."""
    return _Cycle(state, now, capacity, max_admissions, explain).run()


class _Cycle:
    """One cycle: the phases and their order (heads, nominations, the heap, admissions, requeue); fit checks,
    lending, preemption requests and reuse are its collaborators'."""

    # `_refuse_alike`: refuse a queue's run of alike borrowers held out of the same room in one loop (False: one by
    # one through the heap, the reference the tests compare it with)
    batch_refusals = True

    def __init__(self, state: AdmissionState, now: float, capacity: Mapping[str, int] | None,
                 max_admissions: int | None, explain: bool = True):
        self.state = state
        self.explain = explain
        self.book = state.book
        self.now = now
        self.max_admissions = max_admissions
        # 1 heads: the state's own pending lists, in order (with policy.max_age_s: aged to now first); a retried
        # queue's list is swapped in and out during the cycle, and phase 6 leaves each without the admitted
        self.lists: dict[str, list[Entry]] = state.ordered_pending(now)
        # queues whose oldest pending job has starved (starvation.py): admitted in strict order this cycle
        self.starving: Mapping[str, str] = state.starving_queues(now)
        self.idx: dict[str, int] = {}
        self.heap: list[tuple[tuple[int, float, float, str], str]] = []
        self.decision = AdmissionDecision()
        self.admitted_queues: set[str] = set()
        self.scope_admitted: set[str] = set()
        fair = state.config.fair_sharing
        self.fits = FitChecker(state, capacity, fair.preemption_strategies if fair.preemption else None)
        self.lending = LendingGuard(state, self.fits, self.lists)
        self.asks = PreemptionAsks(state, self.fits, self.lending, self.lists)
        # scopes are independent without a capacity cap or a maximum of admissions: the last cycles' are reused
        self.scope_reuse = ScopeReuse(state, self.asks, self.lists, capacity is None and max_admissions is None)
        self.refused_at: dict[str, int] = {}  # queue -> first index whose borrowing was refused in this pass
        self.refused: dict[str, list[Entry]] = {}  # queue -> the jobs whose borrowing was refused in this pass
        self.admitted_since_refusal = 0

    # ------------------------------------------------------------------ phases

    def run(self) -> AdmissionDecision:
        # 1 heads: read in __init__ (and the scopes reused or sealed: ScopeReuse)
        reuse = self.scope_reuse
        # 2 snapshot: the QuotaBook is the live snapshot; capacity was copied by FitChecker
        # 3a/5a within nominal first (Kueue's entry ordering puts entries that fit without borrowing before
        # those that borrow): every job that fits its queue's nominal quota, in the usual order, before any job
        # borrows. A reclaim frees nominal quota for its job; without this, its victim (requeued, and first in
        # the order by share, priority or submit time) borrowed it back and the same reclaim repeated each cycle.
        # (an unchanged scope admitted nothing last time and would decide the same again)
        live = [q for q in sorted(self.lists) if not reuse.skips(q)]
        for q in live:
            self.idx[q] = 0
            self._nominate_within_nominal(q)
        self._admit_within_nominal()
        self.heap.clear()  # left over only when max_admissions stopped it
        # 3 nominate, from each queue's first job again (the jobs just admitted are passed over)
        for q in sorted(self.lists):
            self.idx[q] = 0
            if reuse.skips(q):
                self.idx[q] = len(self.lists[q])
                continue
            self._nominate(q)
        # 4 order + 5 admit; again for the queues whose borrowing was refused while a lender waited, when
        # admissions since may have changed that (so the next cycle, with nothing new, admits nothing more)
        self._admit_and_retry_refused()
        # 5b fair-sharing preemption, against the usage the admissions left
        self.asks.ask_deferred()
        # 6 requeue
        self._requeue()
        return self.decision

    def _admit_and_retry_refused(self) -> None:
        """Phases 4 and 5, then again for the queues whose borrowing was refused while a lender waited, as long as
        admissions since changed the waiting lenders (only then can a refusal turn into an admission)."""
        saved: dict[str, list[Entry]] = {}
        while True:
            self._admit_heads()
            if self._full() or not self.refused_at or not self.admitted_since_refusal \
                    or not self.lending.lenders_changed(self.refused_at):
                break
            retry, self.refused_at, self.admitted_since_refusal = self.refused_at, {}, 0
            refused, self.refused = self.refused, {}
            self.lending.forget_refusals()
            for q in sorted(retry):
                # only the refused jobs can fit now (every other failure stays one: usage only grew), and in a
                # StrictFIFO queue the jobs its refused head blocked
                lst = self.lists[q]
                again = lst[retry[q]:] if self._strict(self.book.queues[q]) else refused[q]
                saved.setdefault(q, lst)
                self.lists[q], self.idx[q] = again, 0
                self._nominate(q)
        for q, lst in saved.items():  # back to the queues' own lists, for phase 6
            self.lists[q] = lst
            self.idx[q] = len(lst)

    def _full(self) -> bool:
        """Whether this cycle admitted its maximum (max_admissions)."""
        return self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions

    def _admit_heads(self) -> None:
        """Phases 4 and 5: pop the best head, re-check it, admit it (or explain it), nominate its queue's next.
        Once a cycle's reclaims hold their room, every borrowing head of the cohort passes here in turn, so the fit
        memo's lookup is inlined as in `_nominate`."""
        heap, fits, lending = self.heap, self.fits, self.lending
        queues, lists, idx = self.book.queues, self.lists, self.idx
        while heap:
            _, q = heapq.heappop(heap)
            qq = queues[q]
            e = lists[q][idx[q]]
            version = fits.version_of(qq)  # `evaluate` reads the memo as below, and changes no version
            result = None
            if not e.pools:
                memo = fits.memo.get(q)
                if memo is not None:
                    result = memo.get(fit_key(e, qq.unsafe_borrow_limit))
            if result is None or result.version != version:
                result = fits.evaluate(qq, e)
            if isinstance(result, Fit):
                fresh = fits.key(qq, e, result)
                if heap and fresh > heap[0][0]:
                    heapq.heappush(heap, (fresh, q))  # someone else's admission changed its flavor
                    continue
                refused = (lending.refusal(qq, e, result, version)
                           if result.borrowing and qq.cohort is not None else None)
                by_hold = False
                if refused is None and result.borrowing and lending.holds and qq.pool in lending.holds:
                    refused = lending.held(qq, result)
                    by_hold = refused is not None
                if refused is not None:
                    e.reason, e.message = Reason.WAITING_FOR_BORROWABLE_QUOTA, refused
                    self.refused_at.setdefault(q, self.idx[q])
                    self.refused.setdefault(q, []).append(e)
                    self.idx[q] += 1
                    if self._strict(qq):
                        self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                        continue
                    if by_hold and self.batch_refusals:
                        self._refuse_alike(q, qq, e, result, version, refused)
                    self._nominate(q)
                    continue
                self._admit(qq, e, result)
                self.idx[q] += 1
                if self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions:
                    break
            else:
                self.asks.fail(qq, e, result)
                self.idx[q] += 1
                if self._strict(qq):
                    self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                    continue
            self._nominate(q)

    def _refuse_alike(self, q: str, qq: QueueQuota, head: Entry, fit: Fit, version: int, message: str) -> None:
        """After `head` was refused for room held by this cycle's reclaims: refuse, with the same message, the run of
        `q`'s next jobs that the unbatched loop would refuse one by one before anything else happens. A job is
        refused here only when it is what `_nominate` then the heap would hand back at once: the fit memo gives it
        the very same Fit (same request, same version), lending refuses it nothing, and its heap key (same share)
        sorts before every other queue's head, so it would be popped next, against holds and usage that nothing has
        moved since `head` (refusals change neither), hence held with the same message. The first job that is not
        such is left to `_nominate`, exactly where the unbatched loop would be. Jobs with a verdict or already
        admitted are passed as `_nominate` passes them. (On the 60-day Philly window's first 8,000 jobs, 97% of
        held refusals were followed so by one of the same queue: deep queues of alike borrowers.)"""
        # (`_nominate`'s early stops cannot apply: `q` admitted nothing since its head was nominated, and a cycle
        # at its max_admissions pops no more heads)
        lst, heap, refused = self.lists[q], self.heap, self.refused[q]
        memo = self.fits.memo[q]
        limit = qq.unsafe_borrow_limit
        refusal = self.lending.refusal
        # lending's memo key is (the fit's usage, priority, preemptible, gives back); without loss_aware_reclaim the
        # last is `preemptible`, so a job with the pair of one lending just let through (`head`'s, at this version)
        # gets the same None from the memo: the call is skipped
        passed = None if self.lending.loss_aware else (head.priority, head.preemptible)
        share = self.fits.key(qq, head, fit)[1]  # the key's share: the fit's, the same for every job of this fit
        waiting = Reason.WAITING_FOR_BORROWABLE_QUOTA
        i, n = self.idx[q], len(lst)
        while i < n:
            e = lst[i]
            if e.verdict is not None:
                e.reason, e.message = e.verdict
            elif e.admitted is None:
                if e.pools or memo.get(e.sid if e.preemptible and (limit is None or e.unsaved_runtime_s <= limit)
                                       else fit_key(e, limit)) is not fit:
                    break
                if passed is None or passed != (e.priority, e.preemptible):
                    if refusal(qq, e, fit, version) is not None:
                        break  # refused by lending: `_nominate` says so
                    if not self.lending.loss_aware:
                        passed = (e.priority, e.preemptible)
                if heap and ((-e.priority, share, e.order[1], e.job_id), q) > heap[0]:
                    break  # another queue's head comes first: `_nominate` pushes this one
                e.reason, e.message = waiting, message
                refused.append(e)
            i += 1
        self.idx[q] = i

    def _admit_within_nominal(self) -> None:
        """Phases 4 and 5 for the jobs that fit their queue's nominal quota (3a/5a in `run`): admitted in the
        usual order; a head that no longer fits within nominal is left to the full pass (phases 3-5), which
        gives every job its reason and its reclaim, so nothing here fails a job or asks for anything."""
        while self.heap:
            _, q = heapq.heappop(self.heap)
            qq = self.book.queues[q]
            e = self.lists[q][self.idx[q]]
            result = self.fits.evaluate(qq, e)
            if type(result) is Fit and not result.borrowing:
                fresh = self.fits.key(qq, e, result)
                if self.heap and fresh > self.heap[0][0]:
                    heapq.heappush(self.heap, (fresh, q))
                    continue
                self._admit(qq, e, result)
                if self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions:
                    return
            self.idx[q] += 1
            self._nominate_within_nominal(q)

    def _nominate_within_nominal(self, q: str) -> None:
        """Push `q`'s next job that fits within its queue's nominal quota (a StrictFIFO queue: only if its head
        does). Jobs passed over get no reason here: the full pass gives them one."""
        lst = self.lists[q]
        qq = self.book.queues.get(q)
        if (qq is None or qq.held or (qq.max_running is not None and self.book.running.get(q, 0) >= qq.max_running)
                or (self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions)):
            self.idx[q] = len(lst)
            return
        if qq.cohort is not None and all(self.book.used(q, r) >= n for r, n in qq.nominal.items()):
            self.idx[q] = len(lst)  # every GPU request would borrow (a job asking for none fits in the full pass)
            return
        i, n = self.idx[q], len(lst)
        strict = self._strict(qq)
        # the priority of the first job passed over that would fit by borrowing and could preempt within its
        # queue: no job of lower priority goes ahead of it, since it could preempt that job (within_queue) and the
        # room would change hands every cycle
        floor: int | None = None
        while i < n:
            e = lst[i]
            if e.verdict is None and e.admitted is None:
                if floor is not None and e.priority < floor:
                    break
                result = self.fits.evaluate(qq, e)
                if type(result) is Fit:
                    if not result.borrowing:
                        self.idx[q] = i
                        heapq.heappush(self.heap, (self.fits.key(qq, e, result), q))
                        return
                    if floor is None and qq.can_preempt_within and self.fits.nominal_request(qq, e.sig) is not None:
                        floor = e.priority
                if strict:
                    break
            i += 1
        self.idx[q] = n

    def _nominate(self, q: str) -> None:
        """Give `q`'s pending jobs their reasons up to the next job that fits, and push that one.
        This loop runs for every pending job every cycle, hence the hoisting and the inlined memo lookup."""
        lst = self.lists[q]
        i = self.idx[q]
        qq = self.book.queues.get(q)
        if qq is None or qq.held:
            self._close(q, qq, lst, i)
            return
        if self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions:
            return  # _requeue explains the rest
        # nothing is admitted while this loop runs, so the running count and the memo version are fixed
        running = self.book.running.get(q, 0)
        full = qq.max_running is not None and running >= qq.max_running
        fits = self.fits
        memo = fits.memo.get(q)
        if memo is None:
            memo = fits.memo[q] = {}
        version = fits.version_of(qq)
        limit = qq.unsafe_borrow_limit
        strict = self._strict(qq)
        n = len(lst)
        while i < n:
            e = lst[i]
            if e.verdict is not None:
                # statically inadmissible jobs never block a queue, StrictFIFO included: they could not
                # be admitted by waiting
                e.reason, e.message = e.verdict
                i += 1
                continue
            if e.admitted is not None:  # admitted earlier in this cycle (met again when a refused queue is retried)
                i += 1
                continue
            if full:
                self.idx[q] = i
                self._block_rest(q, Reason.WAITING_FOR_MAX_RUNNING_JOBS,
                                 f"queue {q} runs {running}/{qq.max_running} jobs (max_running_jobs)")
                return
            # memo key: the request, and whether the job may borrow (negative when it may not: `fit_key`)
            result = None if e.pools else memo.get(e.sid if e.preemptible and (
                limit is None or e.unsaved_runtime_s <= limit) else fit_key(e, limit))
            if result is None or result.version != version:
                result = fits.evaluate(qq, e)
            if type(result) is Fit:
                if result.borrowing and qq.cohort is not None:
                    refused = self.lending.refusal(qq, e, result, version)
                    if refused is not None:
                        e.reason, e.message = Reason.WAITING_FOR_BORROWABLE_QUOTA, refused
                        self.refused_at.setdefault(q, i)
                        self.refused.setdefault(q, []).append(e)
                        i += 1
                        if strict:
                            self.idx[q] = i
                            self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                            return
                        continue
                self.idx[q] = i
                heapq.heappush(self.heap, (self.fits.key(qq, e, result), q))
                return
            if ((result.need is None or not qq.can_reclaim)  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
                    and (result.own is None or not qq.can_preempt_within)  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
                    and result.borrow is None):  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
                e.reason = result.reason  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
                e.message = result.message  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
            else:
                settled = result.settled  # type: ignore[union-attr]  # `type(result) is Fit` above (hot path)
                if settled is not None and (settled := settled.get(e.priority)) is not None:
                    e.reason, e.message = settled
                else:
                    self.asks.fail(qq, e, result)  # type: ignore[arg-type]  # `type(result) is Fit` above (hot path)
            i += 1
            if strict:
                self.idx[q] = i
                self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                return
        self.idx[q] = i

    def _close(self, q: str, qq: QueueQuota | None, lst: list[Entry], i: int) -> None:
        """A deleted or held queue admits nothing: its jobs from `i` on get their verdict or the queue's reason."""
        if qq is None:  # queue deleted by a config change: every job carries its verdict
            for e in lst[i:]:
                e.reason, e.message = e.verdict or (Reason.QUEUE_DELETED, f"queue {q} no longer exists")
        else:
            drain = qq.config.stop_policy is StopPolicy.HOLD_AND_DRAIN
            held = (Reason.QUEUE_HELD, f"queue {q} is held (stop_policy: {qq.config.stop_policy}): it admits nothing "
                    "until its stop_policy is None again; " + (
                        "its preemptible jobs are drained (checkpointed and evicted), jobs of classes never "
                        "preempted keep running" if drain else "its running jobs keep running"))
            for e in lst[i:]:
                e.reason, e.message = e.verdict or held
        self.idx[q] = len(lst)

    def _admit(self, qq: QueueQuota, e: Entry, fit: Fit) -> None:
        flavors = {name: opt[0] for name, opt in zip(e.gpu_pod_sets, fit.choice[:len(e.gpu_pod_sets)], strict=True)}
        w = e.workload
        pool = self.fits.chosen_pool.pop(e.job_id, None) if e.pools else None  # docs/admission.md, node pools
        a = AdmittedWorkload(spec=w.spec if pool is None else with_pool(w.spec, pool), submitted_at=w.submitted_at,
                             admitted_at=self.now, flavors=flavors, usage=dict(fit.usage), borrowing=fit.borrowing,
                             pool=pool)
        self.state.admit_entry(e, a)
        self.admitted_queues.add(qq.name)
        self.scope_admitted.add(qq.scope)
        self.asks.admitted(qq, e)
        self.fits.charge(qq, fit.usage)
        self.decision.admitted.append(a)
        if self.refused_at:
            self.admitted_since_refusal += 1

    def _requeue(self) -> None:
        """Phase 6: reasons for jobs never reached, the pending lists without the admitted, the statuses view
        (positions are computed when read); reclaims grouped by scope; scope caches refreshed (ScopeReuse)."""
        state = self.state
        reuse = self.scope_reuse
        by_scope: dict[str, list[list[Entry]]] = {}
        for q in sorted(self.lists):
            lst = self.lists[q]
            i = self.idx.get(q, 0)
            if i < len(lst) and reuse.scopes[q] not in reuse.clean:  # only after max_admissions stopped it
                for e in lst[i:]:
                    if e.verdict is not None:
                        e.reason, e.message = e.verdict
                    elif e.admitted is None:
                        e.reason = Reason.WAITING_FOR_NEXT_CYCLE
                        e.message = f"this cycle admitted its maximum of {self.max_admissions} jobs"
            remaining = [e for e in lst if e.admitted is None] if q in self.admitted_queues else lst
            state.replace_pending_list(q, remaining)
            if remaining and self.explain:
                by_scope.setdefault(reuse.scopes[q], []).append(remaining.copy())
        settled = reuse.finish(self.decision, self.asks.scope_reclaims, self.scope_admitted, self.admitted_queues,
                               by_scope if self.explain else None)
        state.cycle_done()
        self.decision.pending = (PendingStatuses(state, by_scope, frozenset(by_scope) - reuse.clean, settled)
                                 if self.explain else PendingStatuses.empty())

    def _block_rest(self, q: str, reason: str, message: str) -> None:
        lst = self.lists[q]
        for e in lst[self.idx[q]:]:
            if e.verdict is not None:
                e.reason, e.message = e.verdict
            else:
                e.reason, e.message = reason, message
        self.idx[q] = len(lst)

    def _strict(self, qq: QueueQuota) -> bool:
        """Whether `qq` is admitted in strict order this cycle: StrictFIFO, or its oldest job has starved."""
        return qq.strict_fifo or qq.name in self.starving

    def _strict_message(self, qq: QueueQuota, head: Entry) -> str:
        if not qq.strict_fifo:
            return (f"queue {qq.name} admits in order until {self.starving[qq.name]} is admitted (it waited past "
                    f"the starvation bound, policy.starvation_factor); blocked by {head.job_id} ({head.reason})")
        return f"StrictFIFO queue {qq.name} is blocked by its head {head.job_id} ({head.reason})"
