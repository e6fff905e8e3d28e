"""What an admission cycle's decision is told to the world, besides its admissions: every waiting job's status row
(reason, message, positions) and JobPending when worth it, the reclaims the cycle asks the preemption service for,
and the drains of queues held with HoldAndDrain."""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter

from services.admission.etas import eta_fields
from services.admission.memory import Memory
from services.admission.publish import MESSAGE_EVERY_S, Published, worth_publishing
from services.core.admission import Reason, ReclaimRequest
from services.core.admission.statuses import PendingStatuses, message_text
from services.core.preemption import priority_of
from shared import audit
from shared.audit import service_actor
from shared.config import StopPolicy
from shared.events import JobPending, PreemptionReason, PreemptionRequested
from shared.service import Tx

# (job_id, reason, message, position in queue, position in cohort): a status row as written
StatusRow = tuple[str, str, str, int, int]


class StatusRows:
    """Writes the waiting jobs' statuses after each cycle, and announces those worth announcing."""

    def __init__(self, memory: Memory):
        self.memory = memory
        # When the last cycle walked the settled queues' rows too (see `publish`), service clock
        self._settled_walked_at = float("-inf")

    async def publish(self, tx: Tx, pending: PendingStatuses) -> None:
        """Cohorts the cycle reused unchanged hold the statuses already handled after an earlier cycle. In the
        others, a message whose only news is its numbers (another queue's admission changes the cohort's lendable
        count in every waiting job's message) is rewritten at most once a minute, so one admission in a cohort with
        thousands waiting does not rewrite thousands of rows; reasons and positions always."""
        now = tx.now
        published, announced = self.memory.published, self.memory.announced
        changed: list[StatusRow] = []
        for job_id, queue, reason, raw_message, qpos, cpos in self._candidates(pending, now):
            old = published.get(job_id)
            key = (reason, message_text(raw_message), qpos, cpos)
            if old is not None and old[:4] == key:
                continue
            published[job_id] = (*key, now)
            changed.append((job_id, *key))
            if not worth_publishing(announced.get(job_id), *key, now):
                continue  # a small move or new numbers: the table has it, the bus hears of it later
            announced[job_id] = Published(*key, now)
            await tx.emit(JobPending(job_id=job_id, queue=queue, stage="admission", reason=reason,
                                     message=key[1], position_in_queue=qpos, position_in_cohort=cpos,
                                     **eta_fields(self.memory, job_id)))
        if changed:
            # one statement for all (a cohort's thousands of waiting rows when their reasons move together)
            await tx.conn.execute(
                "UPDATE admission.jobs AS j SET reason = u.r, message = u.m, position_in_queue = u.q, "
                "position_in_cohort = u.c FROM unnest($1::text[], $2::text[], $3::text[], $4::int4[], $5::int4[]) "
                "AS u(id, r, m, q, c) WHERE j.job_id = u.id", *(list(c) for c in zip(*changed, strict=True)))

    def _candidates(self, pending: PendingStatuses, now: float) -> list[tuple[str, str, str, object, int, int]]:
        """The judged rows that may have news, in job id order: first the cheap test on every judged row (a cohort
        with thousands waiting, most unchanged), in the view's order; then sorting only the few left, not every
        waiting row. Queues whose jobs kept their reasons and positions (sealed at their hard cap; core/cycle.py)
        are left out of the walk, a deep backlog's thousands of rows, except once per MESSAGE_EVERY_S: only the
        cohort's numbers in their messages moved, and those are rewritten at most that often anyway."""
        published = self.memory.published
        candidates = []
        walk_settled = now - self._settled_walked_at >= MESSAGE_EVERY_S
        if walk_settled:
            self._settled_walked_at = now
        for row in pending.judged_rows(settled=walk_settled):
            old = published.get(row[0])
            if (old is not None and old[0] == row[2] and old[2] == row[4] and old[3] == row[5]
                    and now - old[4] < MESSAGE_EVERY_S):
                continue
            candidates.append(row)
        candidates.sort(key=itemgetter(0))
        return candidates


class PreemptionRequester:
    """The preemption requests a cycle makes: reclaims of nominal quota (once per preemptor until it is preempted
    or requeued), and drains of queues held with HoldAndDrain."""

    def __init__(self, memory: Memory):
        self.memory = memory
        self._drains_sent: dict[str, set[str]] = {}  # HoldAndDrain queue -> the running jobs last asked to drain

    async def request_reclaims(self, tx: Tx, reclaims: Iterable[ReclaimRequest]) -> None:
        sent = self.memory.reclaims_sent
        for r in reclaims:
            if r.preemptor in sent:
                continue
            sent.add(r.preemptor)
            within = r.reason == Reason.PRIORITY_PREEMPTION
            await tx.emit(PreemptionRequested(
                preemptor=r.preemptor, queue=r.queue,
                reason=PreemptionReason.PRIORITY if within else PreemptionReason.RECLAIM,
                need=r.need, own_need=r.own_need, candidates=r.candidates, max_victim_priority=r.max_victim_priority,
                message=(f"queue {r.queue} makes room in its nominal quota for a higher-priority job" if within
                         else f"queue {r.queue} reclaims its nominal quota")))

    async def drain_held_queues(self, tx: Tx) -> None:
        """stop_policy HoldAndDrain: ask the preemption service to evict each such queue's running jobs that may be
        preempted (its checkpoint-before-preempt protocol; preemption/core/drain.py), whenever the set of those
        jobs has gained one since the last request. Jobs of classes never preempted (production) are not asked
        for and keep running with their quota; evicted jobs come back pending and wait (WaitingForQueueHeld)."""
        state = self.memory.state
        config = state.config
        draining = sorted(q.name for q in config.queues if q.stop_policy is StopPolicy.HOLD_AND_DRAIN)
        for name in sorted(set(self._drains_sent) - set(draining)):
            del self._drains_sent[name]
        if not draining:
            return
        running: dict[str, set[str]] = {name: set() for name in draining}
        for job_id, held in state.admitted.items():
            jobs = running.get(held.spec.queue)
            if jobs is not None and job_id in self.memory.expected_end and priority_of(config, held.spec)[1]:
                jobs.add(job_id)
        for name in draining:
            jobs = running[name]
            if not jobs or jobs <= self._drains_sent.get(name, set()):
                self._drains_sent[name] = jobs
                continue
            self._drains_sent[name] = jobs
            await tx.emit(PreemptionRequested(
                preemptor=f"drain:{name}", queue=name, reason=PreemptionReason.DRAIN, candidates=tuple(sorted(jobs)),
                message=f"queue {name} is held and drained (stop_policy: HoldAndDrain): its preemptible running "
                        "jobs are checkpointed and evicted; jobs of classes never preempted keep running"))
            await audit.record(tx, "drain", service_actor("admission"), queue=name, jobs=sorted(jobs))
