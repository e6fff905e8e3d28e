"""What happens to a job after it was received: cancels and approvals, its placement and start, its end, a
preemption or a failed attempt that sends it back to wait, and the retry backoff that holds it out of its queue
meanwhile. Each handler changes memory and the job's row in the unit of work's transaction, then an admission
cycle runs (`UnitOfWork.then_cycle`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC

import asyncpg

from services.admission.etas import EtaFn
from services.admission.held import AFTER_EVENTS_KEY as HELD_KEY
from services.admission.held import hold_rows, write_held
from services.admission.history import RAN_TO_THE_END, RunHistory
from services.admission.memory import Memory, UnitOfWork
from services.admission.sharding import Shard
from services.core.admission import Workload
from shared import audit
from shared.audit import service_actor, team_actor
from shared.config import StopPolicy
from shared.domain import JobSpec
from shared.events import (
    CloudEvent,
    JobApproved,
    JobAttemptFailed,
    JobCancelled,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    utcnow_from,
)
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.admission")

BACKOFF_REASON = "BackoffAfterFailure"  # a failed attempt waits out its retry backoff (JobAttemptFailed)
BACKOFF_TICK_S = 0.2  # wall seconds between looks at whether a backoff ended (the end itself is platform time)


class JobLifecycle:
    """The handlers of a job's events after its submission. `drain_held_queues` asks for the drain of a queue held
    with HoldAndDrain (a job placed there after the drain began is drained too); `enter_config_epoch` moves a
    per-cohort instance to the configuration in force before a unit of work of its own."""

    def __init__(self, memory: Memory, history: RunHistory, eta: EtaFn | None, shard: Shard, unit: UnitOfWork,
                 drain_held_queues: Callable[[Tx], Awaitable[None]],
                 enter_config_epoch: Callable[[asyncpg.Connection], Awaitable[None]]):
        self.memory = memory
        self.history = history
        self.eta = eta
        self.shard = shard
        self.unit = unit
        self._drain_held_queues = drain_held_queues
        self._enter_config_epoch = enter_config_epoch

    # ------------------------------------------------------------------ asked for: cancels and approvals

    async def on_cancel_requested(self, tx: Tx, event: CloudEvent, payload: JobCancelRequested) -> None:
        """Only the job's team (its credential, or a trusted producer acting for it) may cancel it. A request for a
        job not known yet leaves a tombstone for that team; admission then publishes the authoritative
        JobCancelled, after any JobAdmitted it emitted (one outbox, in order)."""
        team = JobCancelRequested.scope_of(tx.subject) or ""
        actor = team_actor(team)
        job_id = payload.job_id
        claimed = {"claimed_by": payload.requested_by, "reason": payload.reason or None, "event_id": event.id}

        async def body() -> None:
            row = await tx.conn.fetchrow("SELECT team, status FROM admission.jobs WHERE job_id = $1", job_id)
            if row is None:
                await tx.conn.execute(
                    "INSERT INTO admission.tombstones(job_id, team, requested_at, event_id) VALUES ($1, $2, $3, $4) "
                    "ON CONFLICT DO NOTHING", job_id, team, tx.now, event.id)
                await audit.record(tx, "cancel", actor, job_id=job_id, team=team, outcome="tombstone", **claimed)
                return
            if row["team"] != team:
                log.warning("refused a cancel of %s (team %s) requested with team %s's credential", job_id,
                            row["team"], team)
                # (The record is the requesting team's to read: it does not name the job's team.)
                await audit.record(tx, "cancel_refused", actor, job_id=job_id, team=team, outcome="Forbidden",
                                   **claimed)
                return
            if row["status"] not in ("pending", "admitted"):
                await audit.record(tx, "cancel", actor, job_id=job_id, team=team, outcome=f"already {row['status']}",
                                   **claimed)
                return
            await self.finish(tx, job_id, "Cancelled")
            await tx.emit(JobCancelled(job_id=job_id, by=actor, reason=payload.reason,
                                       cancelled_at=utcnow_from(tx.now)))
            await audit.record(tx, "cancel", actor, job_id=job_id, team=team, outcome="cancelled", **claimed)

        await self.unit.then_cycle(tx, body)

    async def on_approved(self, tx: Tx, event: CloudEvent, payload: JobApproved) -> None:
        """An admin's approval (only admin and API credentials may publish it): the job joins its queue, keeping the
        time it was received."""

        async def body() -> None:
            row = await tx.conn.fetchrow(
                "SELECT spec, submitted_at, team, predicted_gpu_s FROM admission.jobs WHERE job_id = $1 AND "
                "status = 'pending' AND approval = 'required'", payload.job_id)
            if row is None:
                await audit.record(tx, "approve", f"admin:{payload.approved_by}", job_id=payload.job_id,
                                   outcome="nothing awaits approval", event_id=event.id)
                return
            spec = JobSpec.model_validate_json(row["spec"])
            self.memory.state.requeue(Workload(spec, row["submitted_at"], predicted_gpu_s=self.history.stored(row)))
            await tx.conn.execute(
                "UPDATE admission.jobs SET approval = 'approved', reason = NULL, message = NULL WHERE job_id = $1",
                payload.job_id)
            await audit.record(tx, "approve", f"admin:{payload.approved_by}", job_id=payload.job_id, team=row["team"],
                               outcome="approved", event_id=event.id)

        await self.unit.then_cycle(tx, body)

    # ------------------------------------------------------------------ placed, started

    async def on_placed(self, tx: Tx, event: CloudEvent, payload: JobPlaced) -> None:
        """Where an admitted job runs (when it was placed: its expected end). The row's update is held for the
        batch's end where it may be (held.py); memory says whether the job is admitted, as its row's status does
        (this instance's jobs: `claim` hands a per-cohort instance only those)."""
        memory = self.memory
        bindings = json.dumps([b.model_dump(mode="json") for b in payload.bindings])
        if self.unit.may_hold(tx):
            updated = payload.job_id in memory.state.admitted
        else:
            updated = await tx.conn.fetchval(
                "UPDATE admission.jobs SET bindings = $2 WHERE job_id = $1 AND status = 'admitted' RETURNING true",
                payload.job_id, bindings)
        if updated:
            memory.expected_end[payload.job_id] = payload.placed_at.timestamp() + payload.spec.max_runtime_s
            memory.etas.pop(payload.job_id, None)
            memory.changed()
            queue = memory.state.config.queue_map.get(payload.spec.queue)
            if queue is not None and queue.stop_policy is StopPolicy.HOLD_AND_DRAIN:
                # admitted before the queue was drained, placed since: it is drained too
                await tx.after_events("admission-drain", self._drain_held_queues)
            if self.unit.may_hold(tx):
                hold_rows(tx).placed[payload.job_id] = bindings  # last: nothing after it can fail
                await tx.after_events(HELD_KEY, write_held)

    async def on_started(self, tx: Tx, event: CloudEvent, payload: JobStarted) -> None:
        """An admitted job started: it is expected to end by its start + max_runtime_s (held as on_placed)."""
        started_at = payload.started_at.timestamp()
        expected_end: float | None = None
        if self.unit.may_hold(tx):
            held = self.memory.state.admitted.get(payload.job_id)
            if held is not None:
                # the same double the row's `started_at + (spec->>'max_runtime_s')::double precision` gives
                expected_end = started_at + float(held.spec.max_runtime_s)
        else:
            row = await tx.conn.fetchrow(
                "UPDATE admission.jobs SET started_at = $2, expected_end = $2 + (spec->>'max_runtime_s')::double "
                "precision WHERE job_id = $1 AND status = 'admitted' RETURNING expected_end", payload.job_id,
                started_at)
            expected_end = None if row is None else row["expected_end"]
        if expected_end is not None:
            self.memory.expected_end[payload.job_id] = expected_end
            if self.eta is not None:  # calibration: the ETAs this job was given against its start
                self.eta.job_started(payload.job_id, started_at)
            self.memory.changed()
            if self.unit.may_hold(tx):
                hold_rows(tx).started[payload.job_id] = (started_at, expected_end)  # last: nothing after it can fail
                await tx.after_events(HELD_KEY, write_held)

    # ------------------------------------------------------------------ ends

    async def on_finished(self, tx: Tx, event: CloudEvent, payload: JobCompleted | JobFailed) -> None:
        async def body() -> None:
            await self.finish(tx, payload.job_id, str(payload.exit_reason), hold=self.unit.may_hold(tx))

        await self.unit.then_cycle(tx, body)

    async def on_cancelled(self, tx: Tx, event: CloudEvent, payload: JobCancelled) -> None:
        """Admission's own decision coming back: already applied when it was emitted, so nothing to do (a forged
        one changes nothing here). Consumed so that per-cohort instances mirror other cohorts' cancels (claim)."""

    async def finish(self, tx: Tx, job_id: str, outcome: str, *, hold: bool = False) -> None:
        """The job ended (`outcome`): memory at once; its row at once, or with `hold` at the batch's end (held.py:
        the update keeps its condition on the row's status, so it changes what it would have changed now)."""
        memory = self.memory
        held = memory.state.admitted.get(job_id) or memory.state.pending.get(job_id)
        end = memory.expected_end.get(job_id)
        if held is not None:  # history for the predicted durations: how long it ran (None: it never ran)
            ran = None if end is None else tx.now - (end - held.spec.max_runtime_s)
            # a job that succeeded or was stopped at its limit ran as long as it needed (or its limit)
            self.history.observe(held.spec, ran if outcome in RAN_TO_THE_END else None, ended_at=tx.now)
        memory.state.finish(job_id)
        memory.backoff.pop(job_id, None)  # cancelled while waiting out a retry backoff
        memory.expected_end.pop(job_id, None)
        memory.etas.pop(job_id, None)
        if hold:
            hold_rows(tx).finished[job_id] = (tx.now, outcome)  # last: nothing after it can fail
            await tx.after_events(HELD_KEY, write_held)
            return
        await tx.conn.execute(
            "UPDATE admission.jobs SET status = 'finished', finished_at = $2, outcome = $3, reason = NULL, "
            "message = NULL, retry_not_before = NULL WHERE job_id = $1 AND status IN ('pending', 'admitted')",
            job_id, tx.now, outcome)

    # ------------------------------------------------------------------ back to waiting: preemption, retry

    async def on_preempted(self, tx: Tx, event: CloudEvent, payload: JobPreempted) -> None:
        """A preempted job goes back to pending with its original submit time and resumes from its checkpoint.
        Only an admitted job is taken: a preemption that crossed the job's end on the bus (it completed, failed or
        was cancelled while its checkpoint was being taken), or that arrives after a failed attempt already put it
        back, changes nothing: requeueing it would run a finished job again."""

        async def body() -> None:
            row = await tx.conn.fetchrow(
                "SELECT spec, submitted_at, predicted_gpu_s FROM admission.jobs WHERE job_id = $1 "
                "AND status = 'admitted'", payload.job_id)
            if row is None:
                return

            spec = JobSpec.model_validate_json(row["spec"])
            self.memory.state.requeue(Workload(spec, row["submitted_at"], predicted_gpu_s=self.history.stored(row)))
            self.memory.expected_end.pop(payload.job_id, None)
            self.memory.reclaims_sent.discard(payload.job_id)
            if self.eta is not None:  # its replays give it the preemptor's cool-down from now
                self.eta.job_preempted(payload.job_id, tx.now)
            await tx.conn.execute(
                "UPDATE admission.jobs SET status = 'pending', admitted_at = NULL, flavors = NULL, usage = NULL, "
                "borrowing = NULL, bindings = NULL, started_at = NULL, expected_end = NULL, resume_from = $2 "
                "WHERE job_id = $1", payload.job_id, payload.checkpoint_uri)
            await tx.emit(JobRequeued(job_id=payload.job_id, spec=spec, resume_from=payload.checkpoint_uri,
                                      submitted_at=utcnow_from(row["submitted_at"])))

        await self.unit.then_cycle(tx, body)

    async def on_attempt_failed(self, tx: Tx, event: CloudEvent, payload: JobAttemptFailed) -> None:
        """A failed attempt the job's retry policy retries: its quota is released at once, and the job waits pending
        outside its queue (BackoffAfterFailure) until `retry_not_before`, when the backoff timer puts it back in the
        queue with its original submit time. Only an admitted job is taken: a redelivery, or an attempt failure
        that arrives after the job was cancelled, changes nothing."""

        async def body() -> None:
            row = await tx.conn.fetchrow(
                "SELECT spec, submitted_at, queue FROM admission.jobs WHERE job_id = $1 AND status = 'admitted'",
                payload.job_id)
            if row is None:
                return
            spec = JobSpec.model_validate_json(row["spec"])
            not_before = payload.retry_not_before.timestamp()
            memory = self.memory
            memory.state.finish(payload.job_id)  # releases the attempt's quota
            memory.expected_end.pop(payload.job_id, None)
            memory.reclaims_sent.discard(payload.job_id)
            memory.forget_published((payload.job_id,))
            memory.backoff[payload.job_id] = not_before
            message = (f"attempt {payload.attempt} of {payload.attempts_allowed} failed ({payload.exit_reason.value}"
                       + (f": {payload.message}" if payload.message else "")
                       + f"); retried not before {payload.retry_not_before.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC")
            await tx.conn.execute(
                "UPDATE admission.jobs SET status = 'pending', admitted_at = NULL, flavors = NULL, usage = NULL, "
                "borrowing = NULL, bindings = NULL, started_at = NULL, expected_end = NULL, resume_from = $2, "
                "retry_not_before = $3, reason = $4, message = $5, position_in_queue = NULL, "
                "position_in_cohort = NULL, eta = NULL, eta_low = NULL, eta_high = NULL WHERE job_id = $1",
                payload.job_id, payload.checkpoint_uri, not_before, BACKOFF_REASON, message)
            await audit.record(tx, "retry", service_actor("admission"), job_id=payload.job_id, team=spec.team,
                               queue=spec.queue, attempt=payload.attempt, attempts_allowed=payload.attempts_allowed,
                               exit_reason=payload.exit_reason.value, retry_not_before=not_before)
            await tx.emit(JobRequeued(job_id=payload.job_id, spec=spec, resume_from=payload.checkpoint_uri,
                                      submitted_at=utcnow_from(row["submitted_at"])))
            await tx.emit(JobPending(job_id=payload.job_id, queue=spec.queue, reason=BACKOFF_REASON, message=message))

        await self.unit.then_cycle(tx, body)

    async def backoff_loop(self, runtime: ServiceRuntime) -> None:
        """Wake jobs whose retry backoff ended (platform clock: virtual time in an accelerated run)."""
        while True:
            await asyncio.sleep(BACKOFF_TICK_S)
            if self.memory.backoff and min(self.memory.backoff.values()) <= runtime.clock.now():
                async with runtime.transaction() as tx:
                    await self.end_backoffs(tx)

    async def end_backoffs(self, tx: Tx) -> None:
        """Put every job whose backoff ended back in its queue (original submit time), then run a cycle."""
        if not self.shard.serves_all:
            await self._enter_config_epoch(tx.conn)
        memory = self.memory  # (read after the epoch: entering it may have reloaded the backoffs)
        due = sorted(j for j, at in memory.backoff.items() if at <= tx.now)
        if not due:
            return
        rows = await tx.conn.fetch(
            "UPDATE admission.jobs SET retry_not_before = NULL, reason = NULL, message = NULL "
            "WHERE job_id = ANY($1::text[]) AND status = 'pending' AND retry_not_before IS NOT NULL "
            "RETURNING job_id, spec, submitted_at, predicted_gpu_s", due)
        for job_id in due:
            memory.backoff.pop(job_id, None)
        for r in sorted(rows, key=lambda r: r["job_id"]):
            memory.state.requeue(Workload(JobSpec.model_validate_json(r["spec"]), r["submitted_at"],
                                          predicted_gpu_s=self.history.stored(r)))
        await self.unit.cycle_and_count(tx)
