"""The admission core's state: pending and admitted workloads, with usage kept incrementally in a QuotaBook.

`submit` validates and authorises; `finish` releases quota; `requeue` puts a job back with its original submit
time; `set_config` swaps the configuration keeping every job. The admission cycle (cycle.py) reads and updates
this state; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import copy
from bisect import insort
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from services.core.admission.admissibility import (
    fit_verdict,
    flavor_options,
    over_quota_messages,
    preemptible,
    priority_class,
    verdict,
)
from services.core.admission.cycle_memo import CycleMemo
from services.core.admission.entry import Entry
from services.core.admission.history import historic_shares
from services.core.admission.model import AdmittedWorkload, Reason, Rejection, Workload
from services.core.admission.node_pools import intern_requests, with_its_pool
from services.core.admission.ordering import Order, order_time
from services.core.admission.pending import PendingWorkloads
from services.core.admission.quota import QueueQuota, QuotaBook
from services.core.admission.resources import (
    GpuOption,
    PodSetDemand,
    Signature,
    request_signature,
)
from services.core.admission.starvation import StarvationWatch, under_guarantee
from services.core.admission.within_queue import AdmittedIndex
from shared.config import QueuesConfig
from shared.domain import JobSpec


def _spec_key(spec: JobSpec) -> str:
    return spec.model_dump_json()


class AdmissionState:
    """The core's snapshot of queues: pending + admitted workloads, usage per queue kept incrementally."""

    def __init__(self, config: QueuesConfig):
        self._config = config
        self._book = QuotaBook(config)
        self._entries: dict[str, Entry] = {}
        self._pending = PendingWorkloads()
        self._admitted: dict[str, AdmittedWorkload] = {}
        self._pending_by_queue: dict[str, list[Entry]] = {}
        self._admitted_by_queue: dict[str, dict[str, Entry]] = {}
        self._dirty: set[str] = set()  # queues whose pending list must be re-filtered/re-sorted
        self._touched: set[str] = set()  # queues whose jobs changed since `take_touched` (summary rows to redo)
        # what the last cycle left for the next (cycle_memo.py): cleared per scope and queue by `_touch`
        self._memo = CycleMemo()
        # Bumped by every change of jobs or config: a cycle's PendingStatuses view reads the entries lazily and
        # is valid only while this has not moved.
        self._generation = 0
        self._sig_ids: dict[Signature, int] = {}  # interned request signatures (bounded by distinct shapes)
        self._history_share: dict[str, float] = {}  # queue -> historic borrowing score (core/history.py)
        # pending jobs whose order time still ages (a duration offset, waited less than policy.max_age_s)
        self._aging: set[str] = set()
        # no starvation (starvation.py): recent admission waits per class, each queue's pending jobs by submit time
        self._starvation = StarvationWatch()
        # within-queue preemption's candidates and lowest preemptible priority per queue, kept as jobs come and go
        self._admitted_index = AdmittedIndex()

    # ------------------------------------------------------------------ views

    @property
    def config(self) -> QueuesConfig:
        return self._config

    @property
    def pending(self) -> Mapping[str, Workload]:
        """job_id -> Workload, every job waiting for admission (including inadmissible ones)."""
        return self._pending.view()

    def pending_of(self, team: str) -> int:
        """How many of `team`'s jobs wait for admission (in O(1): checked on every submission)."""
        return self._pending.of_team(team)

    @property
    def admitted(self) -> Mapping[str, AdmittedWorkload]:
        """job_id -> AdmittedWorkload, every job holding quota (placed, running or about to be)."""
        return MappingProxyType(self._admitted)

    def usage(self, queue: str) -> dict[str, int]:
        """Resource -> amount reserved by the queue's admitted jobs (zeros omitted)."""
        return {r: v for r, v in sorted(self._book.usage.get(queue, {}).items()) if v}

    def running(self, queue: str) -> int:
        return self._book.running.get(queue, 0)

    def borrowed(self, queue: str) -> dict[str, int]:
        return {r: b for r in sorted(self._book.usage.get(queue, {})) if (b := self._book.borrowed(queue, r))}

    def available(self, queue: str, resource: str) -> int:
        """What one more job of `queue` could take of `resource` right now (0 for an unknown queue)."""
        qq = self._book.queues.get(queue)
        return max(0, self._book.available(qq, resource)) if qq is not None else 0

    def priority(self, job_id: str) -> int | None:
        e = self._entries.get(job_id)
        return e.priority if e is not None else None

    def preemptible(self, job_id: str) -> bool | None:
        e = self._entries.get(job_id)
        return e.preemptible if e is not None else None

    def inadmissible(self, job_id: str) -> Rejection | None:
        """Why a pending job cannot be admitted under the current config, if it cannot."""
        e = self._entries.get(job_id)
        if e is None or e.admitted is not None or e.verdict is None:
            return None
        return Rejection(job_id, *e.verdict)

    def take_touched(self) -> set[str]:
        """The queues whose jobs came, went, were admitted or released since the last call (none after it): whose
        summary rows (summary.py `queue_facts`) may have changed. A new configuration changes every row."""
        touched, self._touched = self._touched, set()
        return touched

    def waiting(self, queue: str) -> tuple[int, int, float | None]:
        """A queue's pending jobs: how many, how many the configuration in force cannot admit, and the oldest
        one's submit time (None when none pend). Walks that queue's jobs only."""
        current = self._entries.get
        # A list may still hold a finished or replaced entry until its queue is re-filtered (it is dirty then).
        dirty = queue in self._dirty
        count = inadmissible = 0
        oldest: float | None = None
        for e in self._pending_by_queue.get(queue, ()):
            if e.admitted is not None or (dirty and current(e.job_id) is not e):
                continue
            count += 1
            if e.verdict is not None:
                inadmissible += 1
            at = e.workload.submitted_at
            if oldest is None or at < oldest:
                oldest = at
        return count, inadmissible, oldest

    def copy(self) -> AdmissionState:
        """An independent copy for what-if runs (the ETA's forward simulation, read in a worker thread while the
        handlers change this state): nothing a command or cycle on either changes is shared. Workloads, specs, the
        config and the book's static part are immutable and shared; mutable containers and entries are copied
        (O(jobs) shallow copies: docs/admission.md, "Performance"). An entry's message may be a lazy text reading
        this state's book: what-if runs overwrite messages, never read them."""
        other = copy.copy(self)
        other._book = self._book.copy()
        other._sig_ids = dict(self._sig_ids)  # interned as new shapes arrive, on either side
        other._history_share = dict(self._history_share)
        copy_entry = copy.copy
        entries = {j: copy_entry(e) for j, e in self._entries.items()}
        other._entries = entries
        other._pending = self._pending.copy()
        other._admitted = dict(self._admitted)
        # A list may still hold a finished or replaced (requeued) job's old entry until its queue is re-filtered
        # (it is dirty then): only current entries are mapped, or a requeued job would appear twice in the copy.
        current = self._entries.get
        other._pending_by_queue = {q: [entries[e.job_id] for e in lst if current(e.job_id) is e]
                                   for q, lst in self._pending_by_queue.items()}
        other._admitted_by_queue = {q: {j: entries[j] for j in m} for q, m in self._admitted_by_queue.items()}
        other._dirty = set(self._dirty)
        other._touched = set(self._touched)
        other._aging = set(self._aging)
        other._starvation = self._starvation.copy()
        other._admitted_index = self._admitted_index.copy()
        # no cached cohorts: the entries' messages may still be written lazily from *this* state's numbers
        other._memo = CycleMemo()
        return other

    # ------------------------------------------------------------------ commands

    def set_usage_history(self, decayed_gpu_s: Mapping[str, Mapping[str, float]], half_life_s: float) -> None:
        """Fair share over time: per queue and quota resource, usage in GPU-seconds decayed with `half_life_s`
        (from the metering ledger). Queues are then ordered by current + historic share (core/history.py)."""
        shares = historic_shares(self._book, decayed_gpu_s, half_life_s)
        if shares != self._history_share:
            # the cross-queue order changed: no cohort may reuse a cycle decided under the old one
            for q in sorted(set(shares) | set(self._history_share)):
                if shares.get(q) != self._history_share.get(q):
                    self._touch(q)
            self._history_share = shares

    def history_share(self, queue: str) -> float:
        return self._history_share.get(queue, 0.0)

    def submit(self, w: Workload) -> Rejection | None:
        """Validate and authorise a new job; None = queued. Re-submitting the same spec is a no-op (handlers
        see events at least once); another spec under a known job id is rejected."""
        spec = w.spec
        known = self._entries.get(spec.job_id)
        if known is not None:
            if _spec_key(known.workload.spec) == _spec_key(spec):
                return None
            return Rejection(spec.job_id, Reason.DUPLICATE_JOB_ID,
                             f"job id {spec.job_id} is already {'admitted' if known.admitted else 'pending'} "
                             "with a different spec")
        qq = self._book.queues.get(spec.queue)
        if qq is None:
            known_queues = ", ".join(sorted(self._book.queues)) or "none"
            return Rejection(spec.job_id, Reason.UNKNOWN_QUEUE,
                             f"queue {spec.queue!r} does not exist (queues: {known_queues})")
        if qq.teams and spec.team not in qq.teams:
            return Rejection(spec.job_id, Reason.UNAUTHORIZED,
                             f"team {spec.team!r} may not submit to queue {spec.queue!r} "
                             f"(allowed: {', '.join(sorted(qq.teams))})")
        klass = priority_class(self._config, spec)
        if klass is None:
            return Rejection(spec.job_id, Reason.UNKNOWN_PRIORITY_CLASS,
                             f"priority class {spec.priority_class!r} does not exist (classes: "
                             f"{', '.join(p.name for p in self._config.priority_classes)})")
        verdict = fit_verdict(self._book, qq, request_signature(spec, qq.non_gpu),
                              may_borrow=preemptible(self._config, spec))
        if verdict is not None:
            return Rejection(spec.job_id, *verdict)
        self._add_pending(w)
        return None

    def finish(self, job_id: str) -> None:
        """Completed, failed, cancelled or preempted: forget the job and release its quota. Idempotent."""
        e = self._entries.pop(job_id, None)
        if e is None:
            return
        self._generation += 1
        if e.admitted is not None:
            self._release(e)
        else:
            self._pending.pop(job_id)
            self._dirty.add(e.queue)
            self._touch(e.queue)

    def requeue(self, w: Workload) -> None:
        """Back to pending (after preemption or a failed placement) with its original submit time."""
        self.finish(w.spec.job_id)
        self._add_pending(w, requeued=True)

    def restore_admitted(self, a: AdmittedWorkload) -> None:
        """Rebuild after a restart: record a job admitted earlier (from the store) without a cycle."""
        self.finish(a.spec.job_id)
        a = with_its_pool(self._book.queues.get(a.spec.queue), a)
        e = self._new_entry(Workload(a.spec, a.submitted_at))
        self._entries[e.job_id] = e
        self._mark_admitted(e, a)

    def set_config(self, config: QueuesConfig) -> list[str]:
        """Swap to a new configuration keeping every job. Admitted jobs stay admitted even if their queue is
        now over quota or gone; pending jobs are re-judged (a deleted queue makes them inadmissible until it
        returns). Returns one human message per affected job or queue, sorted."""
        self._generation += 1
        self._config = config
        self._book = QuotaBook(config)
        changed = (self._entries[j].rejudge(config, self._book) for j in sorted(self._entries))
        messages = [m for m in changed if m is not None]
        for e in self._entries.values():  # its queue's non-GPU quota keys and pools may have changed its request
            intern_requests(e, self._book.queues.get(e.queue), self._sig_ids)
        messages.extend(over_quota_messages(self._book))
        # aging restarts from the un-aged order times under the new policy (the next cycle ages them again)
        for j in sorted(self._aging):
            e = self._entries[j]
            e.order = (e.order[0], e.base_at, e.job_id)
        self._aging = {j for j, e in self._entries.items()
                       if e.admitted is None and e.base_at > e.workload.submitted_at}
        self._dirty.update(self._pending_by_queue)
        self._memo.forget_decisions()
        # classes' values and preemptibility may have changed, and the preemption rules
        self._admitted_index.rebuild(e for by_id in self._admitted_by_queue.values() for e in by_id.values())
        return sorted(messages)

    # ------------------------------------------------------------------ read and written by the cycle

    @property
    def book(self) -> QuotaBook:
        """The live quota book (usage per queue and cohort): the cycle's snapshot, which its admissions charge."""
        return self._book

    @property
    def cycle_memo(self) -> CycleMemo:
        """What the last cycle left for the next (cycle_memo.py)."""
        return self._memo

    @property
    def generation(self) -> int:
        """Moves with every change of jobs or config: a cycle's PendingStatuses view is valid while it holds."""
        return self._generation

    def entry(self, job_id: str) -> Entry | None:
        """The job's internal record (pending or admitted), None for an unknown job."""
        return self._entries.get(job_id)

    def admitted_entries(self, queue: str) -> Iterable[Entry]:
        """The records of `queue`'s admitted jobs, in admission order."""
        by_queue = self._admitted_by_queue.get(queue)
        return by_queue.values() if by_queue is not None else ()

    def scope_of(self, queue: str) -> str:
        """The scope whose queues share quota with `queue`: its cohort, or the queue alone."""
        qq = self._book.queues.get(queue)
        return qq.scope if qq is not None else f"queue/{queue}"

    def pending_list(self, queue: str) -> list[Entry] | None:
        """`queue`'s pending entries as the last cycle (or `ordered_pending`) left them, None when none pend."""
        return self._pending_by_queue.get(queue)

    def replace_pending_list(self, queue: str, entries: list[Entry]) -> None:
        """After a cycle: `queue`'s pending entries, in order, without the jobs it admitted (none: forgotten)."""
        if entries:
            self._pending_by_queue[queue] = entries
        else:
            self._pending_by_queue.pop(queue, None)

    def cycle_done(self) -> None:
        """A cycle rewrote the entries' reasons: the statuses views of earlier cycles no longer hold."""
        self._generation += 1

    def ordered_pending(self, now: float | None = None) -> dict[str, list[Entry]]:
        """Per queue, its pending entries in order; lists are re-filtered and re-sorted only when touched. With
        `now` and policy.max_age_s, the order times of jobs that still age are moved to `now` first."""
        if now is not None and self._aging:
            self._age(now)
        for q in sorted(self._dirty):
            lst = [e for e in self._pending_by_queue.get(q, ()) if e.admitted is None
                   and self._entries.get(e.job_id) is e]
            lst.sort(key=_order_of)
            if lst:
                self._pending_by_queue[q] = lst
            else:
                self._pending_by_queue.pop(q, None)
        self._dirty.clear()
        return self._pending_by_queue

    def _age(self, now: float) -> None:
        """Re-key the jobs whose order time moved (Entry.age); a job that waited max_age_s leaves the aging set."""
        max_age = self._config.policy.max_age_s
        if max_age is None:
            return
        for j in sorted(self._aging):
            e = self._entries.get(j)
            moved, done = (False, True) if e is None or e.admitted is not None else e.age(now, max_age)
            if done:
                self._aging.discard(j)
            if moved and e is not None:
                self._dirty.add(e.queue)
                self._touch(e.queue)
                self._generation += 1

    def own_candidates(self, qq: QueueQuota, priority: int, need: Mapping[str, int]) -> tuple[str, ...]:
        """within_queue.py `own_candidates` for `qq`, kept while its admitted jobs and the configuration hold."""
        return self._admitted_index.own_candidates(qq, priority, need,
                                                   ckpt_first=self.config.policy.loss_aware_reclaim)

    def lowest_preemptible(self, queue: str) -> float:
        """The lowest priority among `queue`'s admitted preemptible jobs (+inf when none)."""
        return self._admitted_index.lowest_preemptible(queue)

    def admit_entry(self, e: Entry, a: AdmittedWorkload) -> None:
        """Move a pending entry to admitted. The caller rebuilds the queue's pending list afterwards."""
        self._pending.pop(e.job_id)
        self._mark_admitted(e, a)
        self._starvation.admitted(e.job_id, e.priority, a.admitted_at - a.submitted_at)

    def starving_queues(self, now: float) -> Mapping[str, str]:
        """Queue -> its oldest pending job, for the queues where that job has starved (starvation.py): the cycle
        admits those queues in strict order. A queue whose verdict changed since the last call is touched (its
        cached cycle and sealed reasons no longer hold)."""
        policy, book, entries = self._config.policy, self._book, self._entries

        def under(queue: str) -> bool:
            qq = book.queues.get(queue)
            return qq is not None and under_guarantee(book.usage.get(queue, {}), qq.nominal)

        found, changed = self._starvation.judge(
            now, policy.starvation_factor, policy.starvation_min_wait_s,
            lambda job_id: e.starvation_view() if (e := entries.get(job_id)) is not None else None, under)
        for q in sorted(changed):
            self._touch(q)
            self._generation += 1
        return found

    def _new_entry(self, w: Workload) -> Entry:
        k = priority_class(self._config, w.spec)
        value = k.value if k is not None else 0
        may_be_preempted = preemptible(self._config, w.spec)
        order_at = None
        qq = self._book.queues.get(w.spec.queue)
        if w.predicted_gpu_s is not None:
            nominal = sum(n for r, n in qq.nominal.items() if r in qq.models) if qq is not None else 0
            order_at = order_time(w.submitted_at, w.predicted_gpu_s, nominal, w.spec.total_gpus)
        e = Entry(w, value, may_be_preempted, order_at, qq.non_gpu if qq is not None else ())
        intern_requests(e, qq, self._sig_ids)  # its request's id, and the node pools it may be given
        return e

    def _add_pending(self, w: Workload, *, requeued: bool = False) -> None:
        e = self._new_entry(w)
        e.verdict = verdict(self._config, self._book, w.spec)
        self._entries[e.job_id] = e
        self._starvation.pending(e.queue, e.job_id, w.submitted_at, requeued=requeued)
        if e.base_at > w.submitted_at:
            self._aging.add(e.job_id)
        self._pending.put(w)
        self._touch(e.queue)
        self._generation += 1
        lst = self._pending_by_queue.setdefault(e.queue, [])
        if lst and _order_of(lst[-1]) > e.order:
            insort(lst, e, key=_order_of)  # a binary search and a memmove, not a re-sort of the queue
        else:
            lst.append(e)

    def _mark_admitted(self, e: Entry, a: AdmittedWorkload) -> None:
        self._generation += 1
        e.admitted = a
        self._admitted[e.job_id] = a
        self._admitted_by_queue.setdefault(e.queue, {})[e.job_id] = e
        self._book.add(e.queue, a.usage)
        self._admitted_index.changed(e, 1)
        self._touch(e.queue)

    def _release(self, e: Entry) -> None:
        assert e.admitted is not None
        self._generation += 1
        self._book.add(e.queue, e.admitted.usage, -1)
        self._admitted.pop(e.job_id, None)
        by_queue = self._admitted_by_queue.get(e.queue)
        if by_queue is not None:
            by_queue.pop(e.job_id, None)
        e.admitted = None
        self._admitted_index.changed(e, -1)
        self._touch(e.queue)

    def _touch(self, queue: str) -> None:
        """Something of `queue` changed (a job came, went, was admitted or re-keyed): its scope's cached cycle and
        its sealed reasons no longer hold."""
        self._touched.add(queue)
        self._memo.touch(self.scope_of(queue), queue)

    def options(self, qq: QueueQuota, demand: PodSetDemand) -> tuple[GpuOption, ...]:
        """The flavor options of one pod set in `qq` (admissibility.py `flavor_options`, memoised)."""
        return flavor_options(self._book, qq, demand)

def _order_of(e: Entry) -> Order:
    return e.order
