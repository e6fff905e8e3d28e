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
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from services.admission.core.fair_sharing import fair_victims
from services.admission.core.model import (
    AdmissionDecision,
    AdmittedWorkload,
    Reason,
    ReclaimRequest,
)
from services.admission.core.quota import QueueQuota, QuotaBook
from services.admission.core.reclaim import own_candidates, reclaim_candidates
from services.admission.core.resources import GpuOption, PodSetDemand, Signature
from services.admission.core.state import AdmissionState, Entry
from services.admission.core.statuses import PendingStatuses
from shared.config import FairSharingStrategy, PreemptionPolicy, StopPolicy

# Why a job may not borrow, and the fit memo's key for it (`_fit_key`): the memoised verdict's message says why.
_NO_CHECKPOINT = "no-checkpoint"  # it cannot checkpoint and may run longer than the queue lets such jobs borrow
_NOT_PREEMPTIBLE = "not-preemptible"  # nobody could take a loan back from it: it never borrows
_KEY_SPAN = 1 << 40  # above any request id (`Entry.sid`): the key's quotient says why, its remainder which request
_NO_LOAN = {-1: _NO_CHECKPOINT, -2: _NOT_PREEMPTIBLE}


def _fit_key(e: Entry, limit: int | None) -> int:
    """The fit memo's key of `e`: its request (`sid`) when it may borrow, else negative, one range per reason it
    may not (`_NO_LOAN`), so that jobs of one request but different reasons never share a verdict."""
    if not e.preemptible:
        return -2 * _KEY_SPAN + e.sid
    if limit is not None and e.unsaved_runtime_s > limit:
        return -_KEY_SPAN + e.sid
    return e.sid


class _Fit:
    __slots__ = ("borrowing", "choice", "share", "usage", "usage_id", "version")

    def __init__(self, choice: tuple[GpuOption, ...], usage: dict[str, int], borrowing: bool):
        self.choice = choice
        self.usage = usage
        self.borrowing = borrowing
        self.version = -1  # the memo version it was computed at (the memo stores results, not tuples)
        self.usage_id: int | None = None  # set by the lending-refusal memo when first needed
        # the queue's fair share after admitting `usage` (`_key`), set when first needed: it reads the queue's
        # usage, which only an admission in its scope changes, and that retires this fit (a new memo version)
        self.share: float | None = None


class _Pledge:
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


class _LazyText:
    """A message written only when read, then kept. Most of a deep backlog's messages are never read
    before the next cycle replaces them, and writing them eagerly was a fifth of a cycle."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text: str | None = None

    def __str__(self) -> str:
        if self.text is None:
            self.text = self._write()
        return self.text

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __eq__(self, other: object) -> bool:
        return str(self) == (str(other) if isinstance(other, _LazyText | str) else other)

    __hash__ = None  # type: ignore[assignment]  # compares by text, which may not be written yet

    def _write(self) -> str:
        raise NotImplementedError


def _rewrite_when_read(message: object) -> None:
    """Forget a lazy message's text (and its base's), so that it is written again, from the numbers as they are
    then, when next read."""
    while isinstance(message, _LazyText):
        message.text = None
        message = message.base if isinstance(message, _Then) else None


class _Why(_LazyText):
    """Why a job does not fit, with the numbers of every option. The numbers are those of the cycle's end
    (the book and free capacity as the cycle left them; the statuses view that reads them is valid only
    until the state changes)."""

    __slots__ = ("book", "cap", "options", "qq", "taken")

    def __init__(self, book: QuotaBook, qq: QueueQuota, options: tuple[GpuOption, ...], taken: Mapping[str, int],
                 cap: Mapping[str, int] | None):
        super().__init__()
        self.book, self.qq, self.options, self.taken, self.cap = book, qq, options, taken, cap

    def _write(self) -> str:
        book, qq, cap, taken = self.book, self.qq, self.cap, self.taken
        q = qq.name
        parts = []
        for _m, r, amount in self.options:
            total = taken.get(r, 0) + amount
            used, nominal = book.used(q, r), qq.nominal[r]
            text = f"needs {total} {r}; {q} uses {used}/{nominal} {r}"
            if total <= book.available(qq, r) and cap is not None and (r in cap or ":" not in r):
                text += f"; the cluster has {max(0, cap.get(r, 0))} {r} free"
            elif qq.cohort is None:
                text += " and has no cohort to borrow from"
            else:
                limit = qq.borrowing_limit[r]
                if limit is not None and used + total > nominal + limit:
                    text += f" and may borrow at most {limit}"
                text += f"; cohort {qq.cohort} has {max(0, book.cohort_available(qq.cohort, r))} lendable"
                if used + total <= nominal:
                    lent = sum(book.borrowed(o, r) for o in book.pool_members.get(qq.pool or '', ()) if o != q)
                    text += f", {lent} borrowed by other queues"
            parts.append(text)
        return " | ".join(parts)


class _Then(_LazyText):
    """`<base>; <suffix>`: a shared reason plus what this job's reclaim found."""

    __slots__ = ("base", "suffix")

    def __init__(self, base: str | _LazyText, suffix: str):
        super().__init__()
        self.base, self.suffix = base, suffix

    def _write(self) -> str:
        return f"{self.base}; {self.suffix}"


class _NoFit:
    # few objects per failed check: each one lives to the cycle's end, so the collector promotes it, and
    # enough promotions per cycle trigger a full collection over the whole backlog
    __slots__ = ("borrow", "message", "need", "own", "reason", "settled", "variants", "version")

    def __init__(self, reason: str, message: str | _LazyText, need: dict[str, int] | None,
                 own: dict[str, int] | None = None, borrow: dict[str, int] | None = None):
        self.reason = reason
        self.message = message
        self.variants: dict[str, _LazyText] | None = None  # created when first needed
        self.need = need  # set when the job fits its nominal quota and only borrowers stand in the way
        # set when the job's request fits its queue's nominal quota but its queue's own jobs use it: what
        # within-queue preemption (with, under nominal, a reclaim in the same decision) would have to make room for
        self.own = own
        self.borrow = borrow  # set when it must borrow and the cohort lends too little: its request
        # priority -> (reason, message) once _fail found that every later job of that priority failing this
        # way ends the same (no reclaim candidates; or behind this queue's reclaims, which only grow in a
        # cycle): the scan then skips _fail for them
        self.settled: dict[int, tuple[str, str | _LazyText]] | None = None
        self.version = -1

    def settle(self, priority: int, reason: str, message: str | _LazyText) -> None:
        if self.settled is None:
            self.settled = {}
        self.settled[priority] = (reason, message)


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
    def __init__(self, state: AdmissionState, now: float, capacity: Mapping[str, int] | None,
                 max_admissions: int | None, explain: bool = True):
        self.state = state
        self.explain = explain
        self.book = state.book
        self.now = now
        self.cap_left = dict(capacity) if capacity is not None else None
        self.max_admissions = max_admissions
        self.lists: dict[str, list[Entry]] = {}
        self.idx: dict[str, int] = {}
        self.heap: list[tuple[tuple[int, float, float, str], str]] = []
        # Memoised fit checks are valid while nothing they read changes: an admission changes its cohort's
        # pool (or, without cohort, only its queue), and with `capacity` the free GPUs every queue reads.
        self.version = 0  # admissions so far
        self.scope_version: dict[str, int] = {}
        self.memo: dict[str, dict[int, _Fit | _NoFit]] = {}  # queue -> sid -> result (with its version)
        self.decision = AdmissionDecision()
        self.admitted_queues: set[str] = set()
        self.scopes: dict[str, str] = {}  # queue -> scope (its cohort, or itself)
        self.reuse = capacity is None and max_admissions is None  # scopes are independent: reuse caches
        self.clean: set[str] = set()  # scopes unchanged since their cached result
        self.sealed: set[str] = set()  # queues whose reasons stand (AdmissionState._sealed): not judged again
        self.scope_admitted: set[str] = set()
        self.scope_reclaims: dict[str, list[ReclaimRequest]] = {}
        # reclaim candidates only change when a job is admitted in the cohort
        self.cohort_version: dict[str | None, int] = {}
        self.reclaim_memo: dict[tuple[object, ...], tuple[str, ...]] = {}
        self.pledges: dict[str, _Pledge] = {}  # cohort -> this cycle's reclaims
        self.preempting: dict[str, str] = {}  # queue -> its job asking for within-queue preemption this cycle
        # cohort -> per member queue with admissible pending jobs that fit its nominal quota: (queue, their
        # highest priority, the resources they ask), as at the cohort's first borrowing admission of the cycle
        self.waiting_lenders: dict[str, list[tuple[str, int, frozenset[str]]]] = {}
        # queue -> ((usage id, priority, preemptible) -> memo version, the same key -> the refusal or None)
        self.refusals: dict[str, tuple[dict[tuple[int, int, bool], int], dict[tuple[int, int, bool], str | None]]] = {}
        self.usage_ids: dict[tuple[tuple[str, int], ...], int] = {}  # a fit's usage -> a small id (refusal memo)
        self.lender_usage: dict[str, tuple[tuple[tuple[str, int], ...], ...]] = {}  # cohort -> its lenders' usage
        # cohort -> (a waiting lender never reclaims, the lowest top priority of the LowerPriority ones)
        self.lender_summary: dict[str, tuple[bool, float]] = {}
        # cohort -> (the version it was computed at, per resource its waiting lenders' unused lendable quota)
        self.lender_unused: dict[str, tuple[int, dict[str, list[tuple[str, int, PreemptionPolicy, int]]]]] = {}
        self.refused_at: dict[str, int] = {}  # queue -> first index whose borrowing was refused in this pass
        self.refused: dict[str, list[Entry]] = {}  # queue -> the jobs whose borrowing was refused in this pass
        self.admitted_since_refusal = 0
        self.lowest_own: dict[str, float] = {}  # queue -> lowest priority of its admitted preemptible jobs
        # fair-sharing preemption (opt-in, core/fair_sharing.py): replaces borrow_within_cohort, as in Kueue
        fair = state.config.fair_sharing
        self.fair_strategies = fair.preemption_strategies if fair.preemption else None
        # queue -> its first job that must borrow and found too little lendable: asked for after the admissions,
        # when what is left is known (an admission later in the cycle could take the room its victims free)
        self.fair_deferred: dict[str, tuple[QueueQuota, Entry, _NoFit, dict[str, int]]] = {}
        # pool -> (cohort, resource) -> the free room of that cohort this cycle's preemption requests count on, with
        # the first preemptor: no later admission of the cycle borrows it (Kueue reserves a preempting entry's
        # resources for the rest of the cycle), else the victims would free too little and the request repeat
        self.holds: dict[str, dict[tuple[str, str], tuple[int, str]]] = {}

    # ------------------------------------------------------------------ phases

    def run(self) -> AdmissionDecision:
        # 1 heads
        state = self.state
        self.lists = state.ordered_pending(self.now)  # (with policy.max_age_s: aged to now first)
        self.scopes = {q: state.scope_of(q) for q in self.lists}
        memo = state.cycle_memo
        if self.reuse:
            self.clean = {sc for sc in set(self.scopes.values())
                          if sc in memo.reclaims and sc not in memo.stale}
            self.sealed = self._still_sealed()
        else:
            memo.sealed.clear()  # this cycle's reasons are capped or cut short: the next one judges them again
        # 2 snapshot: the QuotaBook is the live snapshot; capacity was copied in __init__
        # 3a/5a within nominal first (Kueue's entry ordering puts entries that fit without borrowing before
        # those that borrow): every job that fits its queue's nominal quota, in the usual order, before any job
        # borrows. A reclaim frees nominal quota for its job; without this, its victim (requeued, and first in
        # the order by share, priority or submit time) borrowed it back and the same reclaim repeated each cycle.
        # (an unchanged scope admitted nothing last time and would decide the same again)
        live = [q for q in sorted(self.lists) if self.scopes[q] not in self.clean and q not in self.sealed]
        for q in live:
            self.idx[q] = 0
            self._nominate_within_nominal(q)
        self._admit_within_nominal()
        self.heap.clear()  # left over only when max_admissions stopped it
        # 3 nominate, from each queue's first job again (the jobs just admitted are passed over)
        for q in sorted(self.lists):
            self.idx[q] = 0
            if self.scopes[q] in self.clean or q in self.sealed:
                self.idx[q] = len(self.lists[q])
                continue
            self._nominate(q)
        # 4 order + 5 admit; again for the queues whose borrowing was refused while a lender waited, when
        # admissions since may have changed that (so the next cycle, with nothing new, admits nothing more)
        saved: dict[str, list[Entry]] = {}
        while True:
            self._admit_heads()
            full = self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions
            if full or not self.refused_at or not self.admitted_since_refusal or not self._lenders_changed():
                break
            retry, self.refused_at, self.admitted_since_refusal = self.refused_at, {}, 0
            refused, self.refused = self.refused, {}
            self.refusals.clear()
            self.lender_unused.clear()
            for q in sorted(retry):
                # only the refused jobs can fit now (every other failure stays one: usage only grew), and in a
                # StrictFIFO queue the jobs its refused head blocked
                lst = self.lists[q]
                again = lst[retry[q]:] if self.book.queues[q].strict_fifo else refused[q]
                saved.setdefault(q, lst)
                self.lists[q], self.idx[q] = again, 0
                self._nominate(q)
        for q, lst in saved.items():  # back to the queues' own lists, for phase 6
            self.lists[q] = lst
            self.idx[q] = len(lst)
        # 5b fair-sharing preemption, against the usage the admissions left
        for q in sorted(self.fair_deferred):
            assert self.fair_strategies is not None  # deferred only when fair sharing is on
            qq, e, result, request = self.fair_deferred[q]
            if e.admitted is None:
                self._fair_preempt(qq, e, result, request, self.fair_strategies)
        # 6 requeue
        self._requeue()
        return self.decision

    def _admit_heads(self) -> None:
        """Phases 4 and 5: pop the best head, re-check it, admit it (or explain it), nominate its queue's next."""
        while self.heap:
            _, q = heapq.heappop(self.heap)
            qq = self.book.queues[q]
            e = self.lists[q][self.idx[q]]
            result = self._evaluate(qq, e)
            if isinstance(result, _Fit):
                fresh = self._key(qq, e, result)
                if self.heap and fresh > self.heap[0][0]:
                    heapq.heappush(self.heap, (fresh, q))  # someone else's admission changed its flavor
                    continue
                refused = (self._refusal(qq, e, result, self._version(qq))
                           if result.borrowing and qq.cohort is not None else None)
                if refused is None and result.borrowing and self.holds and qq.pool in self.holds:
                    refused = self._held(qq, result)
                if refused is not None:
                    e.reason, e.message = Reason.WAITING_FOR_BORROWABLE_QUOTA, refused
                    self.refused_at.setdefault(q, self.idx[q])
                    self.refused.setdefault(q, []).append(e)
                    self.idx[q] += 1
                    if qq.strict_fifo:
                        self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                        continue
                    self._nominate(q)
                    continue
                self._admit(qq, e, result)
                self.idx[q] += 1
                if self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions:
                    break
            else:
                self._fail(qq, e, result)
                self.idx[q] += 1
                if qq.strict_fifo:
                    self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                    continue
            self._nominate(q)

    def _admit_within_nominal(self) -> None:
        """Phases 4 and 5 for the jobs that fit their queue's nominal quota (3a/5a in `run`): admitted in the
        usual order; a head that no longer fits within nominal is left to the full pass (phases 3-5), which
        gives every job its reason and its reclaim, so nothing here fails a job or asks for anything."""
        while self.heap:
            _, q = heapq.heappop(self.heap)
            qq = self.book.queues[q]
            e = self.lists[q][self.idx[q]]
            result = self._evaluate(qq, e)
            if type(result) is _Fit and not result.borrowing:
                fresh = self._key(qq, e, result)
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
        # the priority of the first job passed over that would fit by borrowing and could preempt within its
        # queue: no job of lower priority goes ahead of it, since it could preempt that job (within_queue) and the
        # room would change hands every cycle
        floor: int | None = None
        while i < n:
            e = lst[i]
            if e.verdict is None and e.admitted is None:
                if floor is not None and e.priority < floor:
                    break
                result = self._evaluate(qq, e)
                if type(result) is _Fit:
                    if not result.borrowing:
                        self.idx[q] = i
                        heapq.heappush(self.heap, (self._key(qq, e, result), q))
                        return
                    if floor is None and qq.can_preempt_within and self._nominal_request(qq, e.sig) is not None:
                        floor = e.priority
                if qq.strict_fifo:
                    break
            i += 1
        self.idx[q] = n

    def _nominate(self, q: str) -> None:
        """Give `q`'s pending jobs their reasons up to the next job that fits, and push that one.
        This loop runs for every pending job every cycle, hence the hoisting and the inlined memo lookup."""
        lst = self.lists[q]
        i = self.idx[q]
        qq = self.book.queues.get(q)
        if qq is None:  # queue deleted by a config change: every job carries its verdict
            for e in lst[i:]:
                e.reason, e.message = e.verdict or (Reason.QUEUE_DELETED, f"queue {q} no longer exists")
            self.idx[q] = len(lst)
            return
        if qq.held:
            drain = qq.config.stop_policy is StopPolicy.HOLD_AND_DRAIN
            held = (Reason.QUEUE_HELD, f"queue {q} is held (stop_policy: {qq.config.stop_policy}): it admits nothing "
                    "until its stop_policy is None again; " + (
                        "its preemptible jobs are drained (checkpointed and evicted), jobs of classes never "
                        "preempted keep running" if drain else "its running jobs keep running"))
            for e in lst[i:]:
                e.reason, e.message = e.verdict or held
            self.idx[q] = len(lst)
            return
        if self.max_admissions is not None and len(self.decision.admitted) >= self.max_admissions:
            return  # _requeue explains the rest
        # nothing is admitted while this loop runs, so the running count and the memo version are fixed
        running = self.book.running.get(q, 0)
        full = qq.max_running is not None and running >= qq.max_running
        memo = self.memo.get(q)
        if memo is None:
            memo = self.memo[q] = {}
        version = self._version(qq)
        limit = qq.unsafe_borrow_limit
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
            # memo key: the request, and whether the job may borrow (negative when it may not: `_fit_key`)
            result = memo.get(e.sid if e.preemptible and (limit is None or e.unsaved_runtime_s <= limit)
                              else _fit_key(e, limit))
            if result is None or result.version != version:
                result = self._evaluate(qq, e)
            if type(result) is _Fit:
                if result.borrowing and qq.cohort is not None:
                    refused = self._refusal(qq, e, result, version)
                    if refused is not None:
                        e.reason, e.message = Reason.WAITING_FOR_BORROWABLE_QUOTA, refused
                        self.refused_at.setdefault(q, i)
                        self.refused.setdefault(q, []).append(e)
                        i += 1
                        if qq.strict_fifo:
                            self.idx[q] = i
                            self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                            return
                        continue
                self.idx[q] = i
                heapq.heappush(self.heap, (self._key(qq, e, result), q))
                return
            if ((result.need is None or not qq.can_reclaim)  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
                    and (result.own is None or not qq.can_preempt_within)  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
                    and result.borrow is None):  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
                e.reason = result.reason  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
                e.message = result.message  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
            else:
                settled = result.settled  # type: ignore[union-attr]  # `type(result) is _Fit` above (hot path)
                if settled is not None and (settled := settled.get(e.priority)) is not None:
                    e.reason, e.message = settled
                else:
                    self._fail(qq, e, result)  # type: ignore[arg-type]  # `type(result) is _Fit` above (hot path)
            i += 1
            if qq.strict_fifo:
                self.idx[q] = i
                self._block_rest(q, Reason.WAITING_IN_STRICT_FIFO, self._strict_message(qq, e))
                return
        self.idx[q] = i

    def _admit(self, qq: QueueQuota, e: Entry, fit: _Fit) -> None:
        flavors = {name: opt[0] for name, opt in zip(e.gpu_pod_sets, fit.choice, strict=True)}
        w = e.workload
        a = AdmittedWorkload(spec=w.spec, submitted_at=w.submitted_at, admitted_at=self.now,
                             flavors=flavors, usage=dict(fit.usage), borrowing=fit.borrowing)
        self.state.admit_entry(e, a)
        self.admitted_queues.add(qq.name)
        self.scope_admitted.add(qq.scope)
        if qq.pool is not None:
            self.cohort_version[qq.pool] = self.cohort_version.get(qq.pool, 0) + 1
        cap = self.cap_left
        if cap is not None:
            for r, amount in fit.usage.items():
                if r in cap or ":" not in r:
                    cap[r] = cap.get(r, 0) - amount
        self.decision.admitted.append(a)
        low = self.lowest_own.get(qq.name)
        if low is not None and e.preemptible and e.priority < low:
            self.lowest_own[qq.name] = float(e.priority)
        if self.refused_at:
            self.admitted_since_refusal += 1
        self.version += 1
        self.scope_version[qq.scope] = self.scope_version.get(qq.scope, 0) + 1

    def _refusal(self, qq: QueueQuota, e: Entry, fit: _Fit, version: int) -> str | None:
        """`_lending_refused`, memoised per (queue, usage, priority, preemptible) until the scope changes: a
        deep queue of borrowing jobs a lender holds its quota back from costs one lookup per job. Keyed by the
        fit's usage, not the job's request: the refusal reads nothing else of the job, and many different
        requests (pod counts, any-of models) end with the same usage."""
        memo = self.refusals.get(qq.name)
        if memo is None:
            memo = self.refusals[qq.name] = ({}, {})
        versions, verdicts = memo  # two dicts of untracked values, not a tuple per entry: fewer objects for
        # the collector to count and promote while the cycle runs
        usage_id = fit.usage_id
        if usage_id is None:
            usage_id = fit.usage_id = self.usage_ids.setdefault(tuple(fit.usage.items()), len(self.usage_ids))
        key = (usage_id, e.priority, e.preemptible)
        if versions.get(key) == version:
            return verdicts[key]
        refused = self._lending_refused(qq, e, fit)
        versions[key] = version
        verdicts[key] = refused
        return refused

    def _lending_refused(self, qq: QueueQuota, e: Entry, fit: _Fit) -> str | None:
        """Lending while the lender waits (decision, issue 15 item 4, where Kueue is reported to refuse too):
        a borrowing admission may not use the unused lendable quota of another queue of the cohort that has
        admissible pending jobs fitting its nominal quota (jobs that would themselves borrow are owed nothing)
        that ask for that resource, and whose reclaim policy could not take this job back
        (`reclaim_within_cohort: Never`; `LowerPriority` and this job's priority is not below the lender's
        highest pending one; or this job is not preemptible). It may still borrow what other lenders lend.
        The message when refused, else None."""
        cohort = qq.pool  # the lenders of the whole cohort tree
        if cohort is None or qq.cohort is None:
            return None
        lenders = self._waiting_lenders(cohort)
        if not lenders:
            return None
        never, lowest_top = self.lender_summary[cohort]
        if e.preemptible and not never and e.priority < lowest_top:
            return None  # every waiting lender could take this job back
        book = self.book
        q = qq.name
        unused_by = self._lenders_unused(cohort, self._version(qq), lenders)
        for r, total in sorted(fit.usage.items()):
            used, nominal, guaranteed = book.used(q, r), qq.nominal.get(r, 0), qq.guaranteed.get(r, 0)
            borrowed = used + total - max(used, nominal)  # what this admission takes above its nominal quota
            if borrowed <= 0:
                continue
            held = 0
            holders = []
            for lender, priority, policy, unused in unused_by.get(r, ()):
                if lender == q:
                    continue
                if not book.flat:  # in a cohort tree, only what can reach this queue is held back from it
                    cap = book.tree.lend_cap(book.queues[lender].cohort or "", qq.cohort, r)
                    if cap is not None:
                        unused = min(unused, cap)
                        if unused <= 0:
                            continue
                if e.preemptible and (policy is PreemptionPolicy.ANY or (
                        policy is PreemptionPolicy.LOWER_PRIORITY and e.priority < priority)):
                    continue  # the lender could take it back when it needs it
                held += unused
                holders.append(lender)
            if not held:
                continue
            own_unused = max(0, nominal - guaranteed - max(0, used - guaranteed))
            lendable = book.cohort_available(qq.cohort, r) - own_unused - held
            if borrowed > lendable:
                return (f"needs to borrow {borrowed} {r}; cohort {qq.cohort} could lend {max(0, lendable)} without "
                        f"the {held} unused {r} of {', '.join(holders)}, which have jobs waiting and could not "
                        f"take a loan to this job back (reclaim_within_cohort)")
        return None

    def _hold(self, qq: QueueQuota, request: Mapping[str, int], first: str) -> None:
        """Hold the free room of `qq`'s cohort that a preemption asked for `request` counts on (`holds`)."""
        if qq.cohort is None or qq.pool is None:
            return  # nothing shares its quota
        holds = self.holds.setdefault(qq.pool, {})
        for r, amount in sorted(request.items()):
            held, who = holds.get((qq.cohort, r), (0, first))
            room = min(held + amount, max(0, self.book.cohort_available(qq.cohort, r)))
            if room > held:
                holds[(qq.cohort, r)] = (room, who)

    def _hold_if_coverable(self, qq: QueueQuota, request: Mapping[str, int], first: str,
                           *needs: tuple[tuple[str, ...], Mapping[str, int]]) -> None:
        """`_hold`, but only when the request can be met: for each (candidates, what they must free) in `needs`,
        the candidates' admitted usage covers it. Preempting a job gives back what admission charged it, and the
        preemption core frees a quota request only from such candidates (fewer of them: only running jobs, none
        inside its protection window, guarantees kept), so when their usage falls short no set of victims can make
        the room and the request fails; holding the free room for it would only keep that room idle, from every
        borrower of the cohort, for as long as the job waits. (The request itself is still made.)"""
        admitted = self.state.admitted
        for candidates, need in needs:
            left = {r: n for r, n in need.items() if n > 0}
            for c in candidates:
                if not left:
                    break
                usage = admitted[c].usage
                for r in sorted(left):
                    left[r] -= usage.get(r, 0)
                    if left[r] <= 0:
                        del left[r]
            if left:
                return
        self._hold(qq, request, first)

    def _held(self, qq: QueueQuota, fit: _Fit) -> str | None:
        """Whether borrowing `fit` would take free room that a reclaim of this cycle counts on (`holds`): the
        message if so, else None."""
        for (cohort, r), (room, first) in self.holds[qq.pool or ""].items():
            u = fit.usage.get(r, 0)
            if u and self.book.cohort_available(cohort, r) - u < room:
                return (f"needs to borrow {u} {r}; the {room} {r} left in cohort {cohort} are held for the jobs "
                        f"preempting or reclaiming this cycle ({first})")
        return None

    def _lenders_unused(self, cohort: str, version: int, lenders: list[tuple[str, int, frozenset[str]]]
                        ) -> dict[str, list[tuple[str, int, PreemptionPolicy, int]]]:
        """Per resource, the waiting lenders that ask for it and still lend some of it: (lender, its top
        pending priority, its reclaim policy, its unused lendable amount), in `lenders` order. Depends only on
        the cohort's usage, so it is kept while `version` (the cohort's memo version) holds, within one pass."""
        hit = self.lender_unused.get(cohort)
        if hit is not None and hit[0] == version:
            return hit[1]
        book = self.book
        by: dict[str, list[tuple[str, int, PreemptionPolicy, int]]] = {}
        for lender, priority, resources in lenders:
            lq = book.queues[lender]
            for r in sorted(resources):
                g = lq.guaranteed.get(r, 0)
                unused = max(0, lq.nominal.get(r, 0) - g - max(0, book.used(lender, r) - g))
                if unused > 0:
                    by.setdefault(r, []).append((lender, priority, lq.reclaim_policy, unused))
        self.lender_unused[cohort] = (version, by)
        return by

    def _lenders_changed(self) -> bool:
        """Did the waiting lenders (who, what they are owed, what they still lend) of the cohorts where borrowing
        was refused change since? Only then can a refusal turn into an admission. Recomputes them."""
        changed = False
        cohorts = {c for q in self.refused_at if (c := self.book.queues[q].pool) is not None}
        for cohort in sorted(cohorts):
            before = self.waiting_lenders.pop(cohort, None)
            before_use = self.lender_usage.get(cohort)
            after = self._waiting_lenders(cohort)
            if before != after or before_use != self.lender_usage.get(cohort):
                changed = True
        return changed

    def _lowest_preemptible(self, q: str) -> float:
        """The lowest priority among `q`'s admitted preemptible jobs (+inf when none); kept up to date by _admit."""
        low = self.lowest_own.get(q)
        if low is None:
            low = min((float(e.priority) for e in self.state.admitted_entries(q)
                       if e.preemptible), default=float("inf"))
            self.lowest_own[q] = low
        return low

    def _waiting_lenders(self, cohort: str) -> list[tuple[str, int, frozenset[str]]]:
        found = self.waiting_lenders.get(cohort)
        if found is not None:
            return found
        found = []
        for member in self.book.pool_members.get(cohort, ()):
            mq = self.book.queues.get(member)
            if mq is None or mq.held:  # a held queue admits nothing, so it is owed nothing back yet
                continue
            if not any(n - mq.guaranteed.get(r, 0) - max(0, self.book.used(member, r) - mq.guaranteed.get(r, 0)) > 0
                       for r, n in mq.nominal.items()):
                continue  # lends nothing now (nor later in this cycle: usage only grows), so holds nothing back
            top: int | None = None
            resources: set[str] = set()
            every = mq.nominal.keys()  # a request within nominal asks for nothing else
            owed: dict[int, dict[str, int] | None] = {}  # sid -> its request within nominal, None if it must borrow
            for e in self.lists.get(member, ()):  # priority order: the first owed job has the top priority
                if e.sid in owed or e.verdict is not None or e.admitted is not None:
                    continue
                request = owed[e.sid] = self._reclaim_need(mq, e.sig)
                if request is not None:  # a job that would itself borrow is owed no loan back
                    top = e.priority if top is None else max(top, e.priority)
                    resources.update(request)
                    if resources >= every:
                        break  # later jobs (of no higher priority) can add neither a resource nor a higher top
            if top is not None:
                found.append((member, top, frozenset(resources)))
        self.waiting_lenders[cohort] = found
        policies = [(self.book.queues[m].reclaim_policy, top) for m, top, _r in found]
        self.lender_summary[cohort] = (
            any(p is PreemptionPolicy.NEVER for p, _t in policies),
            min((float(t) for p, t in policies if p is PreemptionPolicy.LOWER_PRIORITY), default=float("inf")))
        self.lender_usage[cohort] = tuple(tuple(sorted(self.book.usage[m].items())) for m, _p, _r in found)
        return found

    # ------------------------------------------------------------------ sealed queues

    def _queue_alone(self, q: str, lst: list[Entry], sigs: tuple[Signature, ...]) -> bool:
        """Whether the reasons of `q`'s pending jobs (`lst`, whose distinct requests are `sigs`) depend on the
        queue alone, whatever the rest of its cohort does: it is held, or runs its max_running_jobs, or none of
        its jobs' first pod set fits any option even if the cohort lent everything (its usage plus the option
        passes nominal + borrowing limit: no admission, no reclaim, which needs room within nominal, no borrowing)
        and no job could ask the queue's own jobs to make room (within-queue preemption takes only strictly lower
        priorities; the list is in order, so its head has the highest)."""
        qq = self.book.queues.get(q)
        if qq is None or qq.cohort is None:
            return False
        if qq.held or (qq.max_running is not None and self.book.running.get(q, 0) >= qq.max_running):
            return True
        used = self.book.usage[q]
        for sig in sigs:
            if not sig:
                return False  # asks for no GPU: it fits
            for _m, r, amount in self.state.options(qq, sig[0]):
                limit = qq.borrowing_limit.get(r)
                if limit is None or used.get(r, 0) + amount <= qq.nominal[r] + limit:
                    return False
        return not qq.can_preempt_within or not lst or lst[0].priority <= self._lowest_preemptible(q)

    def _still_sealed(self) -> set[str]:
        """The sealed queues whose reasons stand this cycle. Their jobs' reasons depend on the queue alone, so
        while nothing of the queue changed (AdmissionState._touch unseals it) a cycle would give each job the
        same reason again; only the cohort's numbers in their messages move, and those messages are written
        again when next read. Checked again here (cheap: per distinct request), not trusted from the last cycle."""
        sealed = self.state.cycle_memo.sealed
        found: set[str] = set()
        for q in sorted(sealed):
            lst = self.lists.get(q)
            messages, sigs = sealed[q]
            if lst is not None and self.scopes[q] in self.clean:
                found.add(q)  # its whole scope is reused anyway
            elif lst is not None and self._queue_alone(q, lst, sigs):
                found.add(q)
                for message in messages:
                    _rewrite_when_read(message)
            else:
                del sealed[q]
        return found

    def _seal(self) -> None:
        """After the cycle: seal the queues judged now whose reasons depend on the queue alone and that admitted
        nothing this cycle (a job judged before the queue's last admission may carry a reason of the queue as it
        was then)."""
        state = self.state
        sealed = state.cycle_memo.sealed
        for q in sorted(self.lists):
            if q in self.sealed or self.scopes[q] in self.clean:
                continue
            lst = state.pending_list(q)
            if lst is None or q in self.admitted_queues:
                sealed.pop(q, None)
                continue
            sigs = tuple({e.sid: e.sig for e in lst if e.verdict is None}.values())
            if not self._queue_alone(q, lst, sigs):
                sealed.pop(q, None)
                continue
            messages = {id(e.message): e.message for e in lst if isinstance(e.message, _LazyText)}
            sealed[q] = (tuple(messages.values()), sigs)

    def _settled(self, by_scope: dict[str, list[list[Entry]]]) -> frozenset[str]:
        """The sealed queues whose statuses equal the last explaining cycle's but for the numbers in their
        messages: their positions in the cohort moved only if another queue's pending jobs (or their order)
        did. Records this cycle's lists for the next."""
        scope_ends = self.state.cycle_memo.scope_ends
        settled: set[str] = set()
        for sc in sorted(by_scope):
            if sc in self.clean:
                continue
            lists = by_scope[sc]
            ends = {lst[0].queue: [e.order for e in lst] for lst in lists if lst[0].queue not in self.sealed}
            here = [lst[0].queue for lst in lists if lst[0].queue in self.sealed]
            before = scope_ends.get(sc)
            if here and before is not None and all(before.get(q) == ends.get(q) for q in sorted(set(before)
                                                                                                 | set(ends))):
                settled.update(here)
            scope_ends[sc] = ends
        return frozenset(settled)

    def _version(self, qq: QueueQuota) -> int:
        return self.version if self.cap_left is not None else self.scope_version.get(qq.scope, 0)

    def _requeue(self) -> None:
        """Phase 6: reasons for jobs never reached, the pending lists without the admitted, the statuses view
        (positions are computed when read); reclaims grouped by scope; scope caches refreshed."""
        state = self.state
        by_scope: dict[str, list[list[Entry]]] = {}
        for q in sorted(self.lists):
            lst = self.lists[q]
            i = self.idx.get(q, 0)
            if i < len(lst) and self.scopes[q] not in self.clean:  # only after max_admissions stopped it
                for e in lst[i:]:
                    if e.verdict is not None:
                        e.reason, e.message = e.verdict
                    elif e.admitted is None:
                        e.reason = Reason.WAITING_FOR_NEXT_CYCLE
                        e.message = f"this cycle admitted its maximum of {self.max_admissions} jobs"
            remaining = [e for e in lst if e.admitted is None] if q in self.admitted_queues else lst
            state.replace_pending_list(q, remaining)
            if remaining and self.explain:
                by_scope.setdefault(self.scopes[q], []).append(remaining.copy())
        memo = state.cycle_memo
        cache = memo.reclaims
        for sc in sorted(set(self.scopes.values()) | set(self.scope_reclaims)):
            self.decision.reclaims.extend(cache[sc] if sc in self.clean else self.scope_reclaims.get(sc, ()))
        if not self.reuse:
            # the entries now carry this cycle's reasons (capacity-capped or cut short), not the cached cycles'
            cache.clear()
        else:
            for sc in sorted(set(self.scopes.values()) - self.clean):
                if sc in self.scope_admitted:
                    cache.pop(sc, None)
                else:
                    cache[sc] = self.scope_reclaims.get(sc, [])
                    memo.stale.discard(sc)
        settled: frozenset[str] = frozenset()
        if self.reuse:
            self._seal()
            if self.explain:
                settled = self._settled(by_scope)
        else:
            memo.scope_ends.clear()
        state.cycle_done()
        self.decision.pending = (PendingStatuses(state, by_scope, frozenset(by_scope) - self.clean, settled)
                                 if self.explain else PendingStatuses.empty())

    # ------------------------------------------------------------------ fit

    def _evaluate(self, qq: QueueQuota, e: Entry) -> _Fit | _NoFit:
        memo = self.memo.get(qq.name)
        if memo is None:
            memo = self.memo[qq.name] = {}
        key = _fit_key(e, qq.unsafe_borrow_limit)
        hit = memo.get(key)
        version = self._version(qq)
        if hit is not None and hit.version == version:
            return hit
        result = self._assign(qq, e.sig, _NO_LOAN.get(key // _KEY_SPAN) if key < 0 else None)
        result.version = version
        memo[key] = result
        return result

    def _assign(self, qq: QueueQuota, sig: Signature, no_loan: str | None = None) -> _Fit | _NoFit:
        """Flavor assignment: per pod set, the first option that fits without borrowing, else the first that
        fits by borrowing (Kueue's 'prefer a fit without borrowing'), within the free capacity if given.
        `no_loan` set (why the job may not borrow: `_NOT_PREEMPTIBLE`, or `_NO_CHECKPOINT` for a job that cannot
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
                return _NoFit(Reason.NO_FLAVOR, f"queue {qq.name} has no quota for this request", None)
            best: GpuOption | None = None
            best_borrows = False
            for opt in options:
                r = opt[1]
                total = taken.get(r, 0) + opt[2]
                if total > book.available(qq, r):
                    continue
                if cap is not None and total > cap.get(r, 0) and (r in cap or ":" not in r):
                    continue
                borrows = used.get(r, 0) + total > qq.nominal[r]
                if not borrows:
                    best, best_borrows = opt, False
                    break
                if best is None and may_borrow:
                    best, best_borrows = opt, True
            if best is None:
                return self._explain(qq, sig, demand, options, taken, no_loan)
            choice.append(best)
            taken[best[1]] = taken.get(best[1], 0) + best[2]
            borrowing = borrowing or best_borrows
        return _Fit(tuple(choice), taken, borrowing)

    def _key(self, qq: QueueQuota, e: Entry, fit: _Fit) -> tuple[int, float, float, str]:
        # e.order[1]: the submit time, or the duration-aware order time when a prediction was given
        # plus the queue's historic borrowing when the caller gave usage history (core/history.py)
        share = fit.share
        if share is None:
            share = fit.share = self.book.share(qq, fit.usage)
        return (-e.priority, share + self.state.history_share(qq.name), e.order[1], e.job_id)

    # ------------------------------------------------------------------ reasons

    def _explain(self, qq: QueueQuota, sig: Signature, demand: PodSetDemand, options: tuple[GpuOption, ...],
                 taken: Mapping[str, int], no_loan: str | None = None) -> _NoFit:
        """Why pod set `demand` fits none of its options: the reason now, the message (numbers from every
        option) only when someone reads it (`_Why`); reasons follow the first (preferred) option."""
        book = self.book
        q = qq.name
        cap = self.cap_left
        capacity_only = cap is not None and any(
            taken.get(r, 0) + amount <= book.available(qq, r) and (r in cap or ":" not in r)
            for _m, r, amount in options)
        message = _Why(book, qq, options, taken, cap)  # `taken` is this check's own, never changed again
        if capacity_only:
            return _NoFit(Reason.WAITING_FOR_CAPACITY, message, None)
        _m, r, amount = options[0]
        total = taken.get(r, 0) + amount
        used, nominal = book.used(q, r), qq.nominal[r]
        if used + total <= nominal and qq.cohort is not None:
            return _NoFit(Reason.WAITING_FOR_QUOTA, message, self._reclaim_need(qq, sig))  # set: may reclaim
        own = self._nominal_request(qq, sig) if qq.can_preempt_within else None
        if qq.cohort is None:
            return _NoFit(Reason.WAITING_FOR_QUOTA, message, None, own)
        if no_loan is not None and any(taken.get(r2, 0) + n <= book.available(qq, r2) for _m2, r2, n in options):
            if no_loan == _NOT_PREEMPTIBLE:
                # a loan nobody could take back would keep the lender from its own quota for as long as it runs
                return _NoFit(Reason.WAITING_FOR_QUOTA, _Then(
                    message, "it is not preemptible, so it never borrows: it waits for its queue's nominal "
                    f"quota (queue {q})"), None, own)
            # it would fit by borrowing, but the risk of borrowing without a checkpoint is refused
            return _NoFit(Reason.WAITING_FOR_QUOTA, _Then(
                message, f"it cannot checkpoint and may run longer than the "
                f"{qq.unsafe_borrow_limit}s queue {q} allows such jobs to borrow for "
                "(max_borrow_runtime_without_checkpoint_s)"), None, own)
        limit = qq.borrowing_limit[r]
        if limit is not None and used + total > nominal + limit:
            return _NoFit(Reason.WAITING_FOR_QUOTA, message, None, own)
        borrow = (self._first_request(qq, sig)
                  if qq.borrow_threshold is not None or (self.fair_strategies and qq.can_reclaim) else None)
        return _NoFit(Reason.WAITING_FOR_BORROWABLE_QUOTA, message, None, own, borrow)

    def _first_request(self, qq: QueueQuota, sig: Signature) -> dict[str, int]:
        """The request per resource with each pod set's preferred (first) option."""
        taken: dict[str, int] = {}
        for demand in sig:
            options = self.state.options(qq, demand)
            if options:
                _m, r, amount = options[0]
                taken[r] = taken.get(r, 0) + amount
        return dict(sorted(taken.items()))

    def _nominal_request(self, qq: QueueQuota, sig: Signature) -> dict[str, int] | None:
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

    def _reclaim_need(self, qq: QueueQuota, sig: Signature,
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

    def _fail(self, qq: QueueQuota, e: Entry, result: _NoFit) -> None:
        """Record why `e` waits; if it fits its queue's nominal quota and only borrowers stand in the way,
        ask for a reclaim. Several jobs of a cohort may reclaim in one cycle: each request counts the
        earlier ones' demand and the victims already named for them (`_Pledge`), so two requests never
        name the same victim and the needs add up to what the jobs really lack."""
        e.reason, e.message = result.reason, result.message
        if result.need is None or not qq.can_reclaim:
            if result.own is not None and qq.can_preempt_within:
                self._preempt_within(qq, e, result, result.own)
            if result.borrow is not None and self.preempting.get(qq.name) != e.job_id:
                if self.fair_strategies:
                    self.fair_deferred.setdefault(qq.name, (qq, e, result, result.borrow))
                else:
                    self._borrow_within(qq, e, result, result.borrow)
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
            e.message = self._message(result, "", lambda: _Then(
                result.message, f"borrowers hold the quota but none is {who} "
                f"(reclaim_within_cohort: {policy.value})"))
            result.settle(e.priority, e.reason, e.message)
            return
        assert cohort is not None  # can_reclaim: only queues in a cohort reclaim
        pledge = self.pledges.get(cohort)
        if pledge is None:
            pledge = self.pledges[cohort] = _Pledge()
        request = self._reclaim_need(qq, e.sig, pledge.queue_demand.get(q))
        if request is None:  # fits nominal alone, not after the jobs already reclaiming in its queue
            e.message = _Then(result.message, f"waits behind this queue's reclaims ({pledge.first[q]})")
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
            self._hold(qq, request, pledge.first[q])
            e.message = _Then(result.message, f"fits once the capacity reclaimed for {pledge.first[q]} is freed")
            return
        free = tuple(c for c in candidates if c not in pledge.victims) if pledge.victims else candidates
        if not free:
            e.message = _Then(result.message, "every reclaimable borrower is already being reclaimed")
            return
        # (all the candidates: the preemption core may take other victims for this cycle's earlier requests than
        # those earmarked for them here)
        self._hold_if_coverable(qq, request, pledge.first[q], (candidates, need))
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
        e.message = _Then(result.message, f"reclaim of {text} requested from {len(free)} borrowing job(s)")

    def _preempt_within(self, qq: QueueQuota, e: Entry, result: _NoFit, request: Mapping[str, int]) -> None:
        """Within-queue preemption (Kueue `withinClusterQueue: LowerPriority`): the job's request fits its
        queue's nominal quota but the queue's own jobs use it, so its lower-priority preemptible jobs are asked
        to make room. When the queue is under nominal on every resource it lacks and other queues borrow from
        the cohort, the same request also reclaims from them (Kueue preempts in the queue and reclaims in the
        cohort in one decision; `own_need` is then what must come from the queue itself, so that the job ends
        within nominal). One such request per queue and cycle, its first job that needs one (Kueue takes one
        head per queue and cycle); the queue's later jobs wait behind it."""
        q = qq.name
        if e.priority <= self._lowest_preemptible(q):  # nothing of its queue may make room for it
            result.settle(e.priority, e.reason, result.message)
            return
        first = self.preempting.get(q)
        pledge = self.pledges.get(qq.pool) if qq.pool is not None else None
        if first is None and pledge is not None:
            first = pledge.first.get(q)
        if first is not None:
            e.message = _Then(result.message, f"waits behind this queue's preemption for {first}")
            result.settle(e.priority, e.reason, e.message)
            return
        book = self.book
        need: dict[str, int] = {}
        over: dict[str, int] = {}
        for r, amount in request.items():
            short = amount - max(0, book.available(qq, r))
            if short > 0:
                need[r] = short
                over[r] = max(0, book.used(q, r) + amount - qq.nominal[r])
        if not need:
            return
        version = self.scope_version.get(qq.scope, 0)
        key = ("own", q, e.priority, tuple(need), version)
        own = self.reclaim_memo.get(key)
        if own is None:
            own = self.reclaim_memo[key] = own_candidates(self.state, qq, e.priority, need)
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
        self._hold_if_coverable(qq, request, e.job_id, (own, own_need), (found + own, need))
        if borrowers:
            assert qq.pool is not None  # can_reclaim: only queues in a cohort reclaim
            pledge = self.pledges.setdefault(qq.pool, _Pledge())
            pledge.first.setdefault(q, e.job_id)
            pledge.victims.update(borrowers)
        reason = Reason.RECLAIM_QUOTA if borrowers else Reason.PRIORITY_PREEMPTION
        self.scope_reclaims.setdefault(qq.scope, []).append(ReclaimRequest(
            preemptor=e.job_id, queue=q, need=need, candidates=borrowers + own, reason=reason, own_need=own_need))
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        also = f" and reclaim from {len(borrowers)} borrowing job(s)" if borrowers else ""
        e.reason = Reason.WAITING_FOR_RECLAIM if borrowers else Reason.WAITING_FOR_PREEMPTION
        e.message = _Then(result.message, f"preemption of {text} requested from {len(own)} lower-priority "
                          f"job(s) of queue {q}{also} (within_queue: {qq.config.preemption.within_queue.value})")

    def _borrow_within(self, qq: QueueQuota, e: Entry, result: _NoFit, request: Mapping[str, int]) -> None:
        """Kueue `borrowWithinCohort` (KEP-1337): a job that must borrow, and finds too little lendable in its
        cohort, may preempt other queues' borrowers of strictly lower priority, at most the queue's
        `max_priority_threshold`, to get the room it borrows. Such victims, requeued, cannot take it back (lower
        priority). One such request per queue and cycle, like within-queue preemption."""
        q, cohort = qq.name, qq.pool
        assert cohort is not None and qq.borrow_threshold is not None  # set only for queues that can reclaim
        pledge = self.pledges.setdefault(cohort, _Pledge())
        first = self.preempting.get(q) or pledge.first.get(q)
        if first is not None:
            e.message = _Then(result.message, f"waits behind this queue's preemption for {first}")
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
        self._hold_if_coverable(qq, request, e.job_id, (below, need))
        pledge.first.setdefault(q, e.job_id)
        pledge.victims.update(candidates)
        threshold = None if qq.borrow_threshold == float("inf") else int(qq.borrow_threshold)
        self.scope_reclaims.setdefault(qq.scope, []).append(ReclaimRequest(
            preemptor=e.job_id, queue=q, need=need, candidates=candidates,
            max_victim_priority=int(limit) if threshold is not None else e.priority - 1))
        text = ", ".join(f"{n} {r}" for r, n in need.items())
        e.reason = Reason.WAITING_FOR_RECLAIM
        e.message = _Then(result.message, f"preemption of {text} requested from {len(candidates)} lower-priority "
                          "borrowing job(s) in order to borrow (borrow_within_cohort)")

    def _fair_preempt(self, qq: QueueQuota, e: Entry, result: _NoFit, request: Mapping[str, int],
                      strategies: tuple[FairSharingStrategy, ...]) -> None:
        """Fair-sharing preemption (core/fair_sharing.py): a job that must borrow and finds too little lendable
        asks other queues' borrowers to make room when the strategies say its queue's share, with it admitted,
        is not above theirs. One such request per queue and cycle, like within-queue preemption."""
        q, pool = qq.name, qq.pool
        assert pool is not None  # only queues in a cohort borrow
        pledge = self.pledges.setdefault(pool, _Pledge())
        first = self.preempting.get(q) or pledge.first.get(q)
        if first is not None:
            e.message = _Then(result.message, f"waits behind this queue's preemption for {first}")
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
        victims = fair_victims(self.state, qq, request, free, strategies, self._comeback(e.priority, free)) \
            if free else ()
        if not victims:
            e.message = _Then(result.message, "no borrower is above this queue's fair share with the job admitted "
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
        e.message = _Then(result.message, f"preemption of {text} requested from {len(victims)} job(s) of queues "
                          "above their fair share (fair_sharing)")

    def _comeback(self, priority: int, candidates: list[str]) -> dict[str, list[dict[str, int]]]:
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
                request = self._first_request(qq, e.sig)
                if request:
                    usages.append(request)
        return found

    @staticmethod
    def _message(result: _NoFit, variant: str, build: Callable[[], _LazyText]) -> _LazyText:
        """Messages shared by every job that failed the same way (one string, not one per job); kept on
        the memoised result itself so it dies with it."""
        if result.variants is None:
            result.variants = {}
        msg = result.variants.get(variant)
        if msg is None:
            msg = result.variants[variant] = build()
        return msg

    def _block_rest(self, q: str, reason: str, message: str) -> None:
        lst = self.lists[q]
        for e in lst[self.idx[q]:]:
            if e.verdict is not None:
                e.reason, e.message = e.verdict
            else:
                e.reason, e.message = reason, message
        self.idx[q] = len(lst)

    @staticmethod
    def _strict_message(qq: QueueQuota, head: Entry) -> str:
        return f"StrictFIFO queue {qq.name} is blocked by its head {head.job_id} ({head.reason})"
