"""The preemption service: checkpoint before preempt, as a state machine persisted in the `preemption` schema.

  PreemptionRequested ──select victims (pure core)──▶ per victim: row `checkpointing` + CheckpointRequested
  JobCheckpointed (or the deadline = requested + checkpoint_grace_s, checked by a background loop on the
  runtime clock) ──▶ row `preempted` + JobPreempted(reason, preemptor, lost GPU-seconds, checkpoint URI)
  The scheduler frees the GPUs on JobPreempted; admission requeues the victim (JobRequeued) to resume from
  the checkpoint, keeping its original submit time.

Exactly-once per victim: every transition is a guarded UPDATE (`WHERE state = 'checkpointing'`) and a
partial unique index allows one open protocol per job, so a restart of any service mid-protocol (events
redelivered, deadlines re-read from the table) neither loses the victim nor preempts it twice.
Victims that cannot checkpoint (spec.checkpoint.supported = false) are preempted at once: waiting for a
checkpoint that will never come would only delay the preemptor.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from services.preemption.core import (
    PRIORITY,
    RECLAIM,
    Outcome,
    Preemptor,
    RunningJob,
    cooldown_verdict,
    drain_plan,
    priority_of,
    protection_ends,
    rate_limit_verdict,
    select_victims,
)
from services.preemption.store import load_config, load_snapshot
from shared import audit
from shared.audit import service_actor
from shared.config import ConfigError, QueuesConfig, StopPolicy, parse_queues
from shared.domain import JobSpec
from shared.events import (
    CheckpointRequested,
    CloudEvent,
    JobAdmitted,
    JobAttemptFailed,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    PreemptionReason,
    PreemptionRequested,
    QueueConfigChanged,
    utcnow_from,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx

if TYPE_CHECKING:
    from services.stack import StackSettings

log = logging.getLogger("gpuq.preemption")
MIGRATIONS = Path(__file__).parent / "migrations"


class PreemptionService:
    def __init__(self, config: QueuesConfig, *, tick_s: float = 0.2):
        self.initial_config = config
        self.config = config
        self.tick_s = tick_s

    def spec(self) -> ServiceSpec:
        return ServiceSpec(
            name="preemption", schema="preemption", migrations=MIGRATIONS, singleton=True,
            handlers={PreemptionRequested: self.on_requested, JobCheckpointed: self.on_checkpointed,
                      JobSubmitted: self.on_submitted, JobAdmitted: self.on_admitted, JobPlaced: self.on_placed,
                      JobStarted: self.on_started, JobCompleted: self.on_ended, JobFailed: self.on_ended,
                      JobAttemptFailed: self.on_attempt_failed,
                      JobCancelled: self.on_ended, JobRequeued: self.on_requeued,
                      QueueConfigChanged: self.on_config_changed},
            on_start=self.load, background=(self.deadline_loop,),
            # Its memory (the queue config) is set from the event alone: applying an event again changes nothing.
            optimistic_batches=True,
        )

    async def load(self, runtime: ServiceRuntime) -> None:
        async with runtime.pool.acquire() as conn:
            if not await conn.fetchval("SELECT count(*) FROM preemption.config"):
                await conn.execute("INSERT INTO preemption.config(applied_at, document) VALUES ($1, $2)",
                                   runtime.clock.now(), self.initial_config.model_dump_json())
            self.config = await load_config(conn, self.initial_config)

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        try:
            config = parse_queues(payload.config, f"QueueConfigChanged {event.id}")
        except (ConfigError, ValidationError) as exc:
            log.error("ignoring an invalid queue configuration (admission refuses it too): %s", exc)
            return
        await tx.conn.execute("INSERT INTO preemption.config(applied_at, document) VALUES ($1, $2)",
                              tx.now, json.dumps(payload.config))
        self.config = config

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        await tx.conn.execute(
            "INSERT INTO preemption.jobs(job_id, spec, queue, status) VALUES ($1, $2, $3, 'submitted') "
            "ON CONFLICT (job_id) DO NOTHING", payload.spec.job_id, payload.spec.model_dump_json(),
            payload.spec.queue)

    async def on_admitted(self, tx: Tx, event: CloudEvent, payload: JobAdmitted) -> None:
        models = json.dumps(sorted(set(payload.flavors.values())))
        await tx.conn.execute(
            """INSERT INTO preemption.jobs(job_id, spec, queue, status, allowed_models)
               VALUES ($1, $2, $3, 'admitted', $4)
               ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, allowed_models = excluded.allowed_models,
                 status = 'admitted' WHERE preemption.jobs.status IN ('submitted', 'admitted', 'preempted')""",
            payload.job_id, payload.spec.model_dump_json(), payload.spec.queue, models)

    async def on_requeued(self, tx: Tx, event: CloudEvent, payload: JobRequeued) -> None:
        await tx.conn.execute(
            "UPDATE preemption.jobs SET status = 'submitted', bindings = NULL WHERE job_id = $1 "
            "AND status IN ('preempted', 'submitted', 'admitted')", payload.job_id)

    async def on_placed(self, tx: Tx, event: CloudEvent, payload: JobPlaced) -> None:
        # A new run: lost work is counted from here (earlier progress is in the checkpoint it resumes from).
        await tx.conn.execute(
            """INSERT INTO preemption.jobs(job_id, spec, queue, status, bindings, placed_at)
               VALUES ($1, $2, $3, 'placed', $4, $5)
               ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, status = 'placed',
                 bindings = excluded.bindings, placed_at = excluded.placed_at, started_at = NULL,
                 last_checkpoint_at = NULL
               WHERE preemption.jobs.status NOT IN ('placed', 'running', 'preempting', 'finished')""",
            payload.job_id, payload.spec.model_dump_json(), payload.spec.queue,
            json.dumps([b.model_dump(mode="json") for b in payload.bindings]), payload.placed_at.timestamp())
        # The preemptor found room before its victims were stopped: let them run on.
        await self._abort_open(tx, "preemptor = $1", payload.job_id, "preemptor placed before the checkpoint")
        await tx.conn.execute("DELETE FROM preemption.deferred WHERE preemptor = $1", payload.job_id)

    async def on_started(self, tx: Tx, event: CloudEvent, payload: JobStarted) -> None:
        status = await tx.conn.fetchval(
            "UPDATE preemption.jobs SET started_at = $2, status = CASE WHEN status = 'placed' THEN 'running' "
            "ELSE status END WHERE job_id = $1 AND status IN ('placed', 'running', 'preempting') RETURNING status",
            payload.job_id, payload.started_at.timestamp())
        if status is None and await tx.conn.fetchval(
                "SELECT 1 FROM preemption.jobs WHERE job_id = $1 AND status IN ('submitted', 'admitted')",
                payload.job_id):
            # JobPlaced travels on another subject and has not arrived yet: retry (bounded, with delay).
            raise LookupError(f"{payload.job_id} started before its placement reached us")

    async def on_ended(self, tx: Tx, event: CloudEvent, payload: JobCompleted | JobFailed | JobCancelled) -> None:
        await tx.conn.execute("UPDATE preemption.jobs SET status = 'finished', bindings = NULL WHERE job_id = $1",
                              payload.job_id)
        await self._abort_open(tx, "victim = $1", payload.job_id, f"victim ended ({type(payload).__name__})")
        await self._abort_open(tx, "preemptor = $1", payload.job_id, f"preemptor ended ({type(payload).__name__})")
        await tx.conn.execute("DELETE FROM preemption.deferred WHERE preemptor = $1", payload.job_id)

    async def on_attempt_failed(self, tx: Tx, event: CloudEvent, payload: JobAttemptFailed) -> None:
        """A failed attempt that will be retried: stopped, like a preempted job (not finished: its JobRequeued and
        its next admission make it a candidate again once it runs). Nothing is preempted for or of it meanwhile."""
        await tx.conn.execute("UPDATE preemption.jobs SET status = 'preempted', bindings = NULL WHERE job_id = $1 "
                              "AND status IN ('placed', 'running', 'preempting')", payload.job_id)
        await self._abort_open(tx, "victim = $1", payload.job_id, "victim's attempt failed")
        await self._abort_open(tx, "preemptor = $1", payload.job_id, "preemptor's attempt failed")
        await tx.conn.execute("DELETE FROM preemption.deferred WHERE preemptor = $1", payload.job_id)

    async def _abort_open(self, tx: Tx, where: str, job_id: str, why: str) -> None:
        rows = await tx.conn.fetch(
            f"UPDATE preemption.preemptions SET state = 'aborted', abort_reason = $2 "
            f"WHERE {where} AND state = 'checkpointing' RETURNING victim", job_id, why)
        for r in rows:
            await tx.conn.execute("UPDATE preemption.jobs SET status = 'running' WHERE job_id = $1 "
                                  "AND status = 'preempting'", r["victim"])

    # ------------------------------------------------------------------ the protocol

    async def on_requested(self, tx: Tx, event: CloudEvent, payload: PreemptionRequested) -> None:
        # The request's event id names the protocol: a redelivery is skipped by the inbox. A newer request for
        # the same preemptor supersedes a deferred older one.
        await tx.conn.execute("DELETE FROM preemption.deferred WHERE preemptor = $1", payload.preemptor)
        await self._run_request(tx, event.id, payload, origin=event.id, attempt=0)

    async def _run_request(self, tx: Tx, pid: str, payload: PreemptionRequested, *, origin: str,
                           attempt: int) -> None:
        """One attempt at a request: select victims (pure core) and start the protocol, or record why not."""

        async def record(outcome: str, message: str, victims: tuple[str, ...] = ()) -> None:
            await tx.conn.execute(
                "INSERT INTO preemption.requests(preemption_id, preemptor, queue, reason, need, requested_at, "
                "outcome, message, victims) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                pid, payload.preemptor, payload.queue, payload.reason.value, json.dumps(payload.need), tx.now,
                outcome, message, list(victims))

        if payload.reason is PreemptionReason.DRAIN:
            await self._drain(tx, pid, payload, origin=origin, attempt=attempt, record=record)
            return
        if await tx.conn.fetchval("SELECT 1 FROM preemption.preemptions WHERE preemptor = $1 "
                                  "AND state = 'checkpointing' LIMIT 1", payload.preemptor):
            await record(Outcome.DUPLICATE, "a preemption for this job is already in progress")
            return
        row = await tx.conn.fetchrow("SELECT spec, status, allowed_models, last_preempted_at FROM preemption.jobs "
                                     "WHERE job_id = $1", payload.preemptor)
        if row is None and attempt > 0:
            await record(Outcome.NOT_WAITING, "the preemptor is no longer known")
            return
        if row is None:
            # JobSubmitted/JobAdmitted travel on other subjects and may not be here yet: retry later.
            raise LookupError(f"preemptor {payload.preemptor} is not known yet")
        if row["status"] not in ("submitted", "admitted"):
            await record(Outcome.NOT_WAITING, f"the preemptor is {row['status']}")
            return
        config = self.config
        why = cooldown_verdict(config, row["last_preempted_at"], tx.now)
        if why is not None:
            await record(Outcome.COOLDOWN, why)
            return
        spec = JobSpec.model_validate_json(row["spec"])
        snap = await load_snapshot(tx.conn, config)
        allowed = tuple(json.loads(row["allowed_models"] or "[]"))
        # admission's requests are about quota (`need`, and `own_need` for within-queue preemption); the
        # scheduler's priority requests are about room on the nodes
        for_quota = payload.reason is PreemptionReason.RECLAIM or bool(payload.own_need)
        if for_quota and not allowed:
            allowed = tuple(sorted({r.split(":", 1)[0] for r in payload.need}))
        preemptor = Preemptor(job_id=spec.job_id, queue=spec.queue, priority=priority_of(config, spec)[0],
                              kind=spec.kind, spec=spec,
                              reason=RECLAIM if payload.reason is PreemptionReason.RECLAIM else PRIORITY,
                              allowed_models=allowed, need=dict(payload.need) if for_quota else {},
                              own_need=dict(payload.own_need), max_victim_priority=payload.max_victim_priority)
        selection = select_victims(preemptor, snap.running, snap.cluster, config, tx.now, busy=snap.busy)
        if not selection.victims:
            retry_at = None
            if selection.why != "FitsWithoutPreemption":
                retry_at = protection_ends(snap.running, selection.rejected, tx.now,
                                           config.policy.protection_window_s)
            if retry_at is not None:
                # Only protection stands in the way: run it again when the earliest protection ends.
                await record(Outcome.DEFERRED, f"{selection.why}: {selection.message}; retry at "
                             f"{utcnow_from(retry_at).isoformat()} when protection ends")
                await self._defer(tx, payload, origin, attempt, retry_at)
                return
            outcome = Outcome.FITS if selection.why == "FitsWithoutPreemption" else Outcome.NO_VICTIMS
            await record(outcome, f"{selection.why}: {selection.message}")
            return
        recent = [r["requested_at"] for r in await tx.conn.fetch(
            "SELECT requested_at FROM preemption.preemptions WHERE queue = $1 AND state <> 'aborted' "
            "AND requested_at > $2", spec.queue, tx.now - 3600.0)]
        why = rate_limit_verdict(config, spec.queue, recent, tx.now, len(selection.victims))
        if why is not None:
            await record(Outcome.RATE_LIMITED, why, selection.victims)
            return
        await record(Outcome.STARTED, f"{len(selection.victims)} victim(s), about "
                     f"{selection.lost_gpu_seconds:.0f} GPU-seconds of work at risk", selection.victims)
        await self._start(tx, pid, payload, spec.job_id, spec.queue, selection.victims,
                          {j.job_id: j for j in snap.running})

    async def _defer(self, tx: Tx, payload: PreemptionRequested, origin: str, attempt: int, retry_at: float) -> None:
        """Run the request again at `retry_at` (when a protection window ends); a newer request supersedes it."""
        await tx.conn.execute(
            "INSERT INTO preemption.deferred(preemptor, preemption_id, attempt, payload, retry_at) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (preemptor) DO UPDATE SET "
            "preemption_id = excluded.preemption_id, attempt = excluded.attempt, "
            "payload = excluded.payload, retry_at = excluded.retry_at",
            payload.preemptor, origin, attempt, payload.model_dump_json(), retry_at)

    async def _drain(self, tx: Tx, pid: str, payload: PreemptionRequested, *, origin: str, attempt: int,
                     record: Callable[..., Awaitable[None]]) -> None:
        """stop_policy HoldAndDrain (core/drain.py): evict the queue's preemptible running jobs with the
        checkpoint protocol; production and non-preemptible jobs keep running; protected ones are drained when
        their window ends (the request is deferred until then)."""
        config = self.config
        q = config.queue_map.get(payload.queue)
        if q is None or q.stop_policy is not StopPolicy.HOLD_AND_DRAIN:
            await record(Outcome.NO_VICTIMS, f"queue {payload.queue} is not HoldAndDrain (any more): nothing drained")
            return
        if attempt == 0 and payload.candidates:
            # admission names the running jobs it drains; JobPlaced travels on another stream and may not be
            # here yet: retry (bounded, with delay) rather than miss one
            unseen = await tx.conn.fetch(
                "SELECT c FROM unnest($1::text[]) AS c LEFT JOIN preemption.jobs j ON j.job_id = c "
                "WHERE j.job_id IS NULL OR j.status IN ('submitted', 'admitted') ORDER BY c", list(payload.candidates))
            if unseen:
                raise LookupError(f"the placement of {unseen[0]['c']} (queue {payload.queue}, draining) has not "
                                  "reached the preemption service yet")
        snap = await load_snapshot(tx.conn, config)
        plan = drain_plan(payload.queue, snap.running, tx.now, config.policy.protection_window_s, snap.busy)
        kept = ", ".join(f"{j} ({why})" for j, why in sorted(plan.kept.items())) or "none"
        if plan.retry_at is not None:
            await self._defer(tx, payload, origin, attempt, plan.retry_at)
        if not plan.victims:
            outcome = Outcome.DEFERRED if plan.retry_at is not None else Outcome.NO_VICTIMS
            await record(outcome, f"queue {payload.queue} drains: nothing to evict now; kept: {kept}")
            return
        await record(Outcome.STARTED, f"queue {payload.queue} drains {len(plan.victims)} job(s); kept: {kept}",
                     plan.victims)
        await self._start(tx, pid, payload, payload.preemptor, payload.queue, plan.victims,
                          {j.job_id: j for j in snap.running})

    async def _start(self, tx: Tx, pid: str, payload: PreemptionRequested, preemptor: str, queue: str,
                     victims: tuple[str, ...], by_id: Mapping[str, RunningJob]) -> None:
        """Open the checkpoint-before-preempt protocol for each victim."""
        config = self.config
        deadline = tx.now + config.policy.checkpoint_grace_s
        for victim_id in victims:
            victim = by_id[victim_id]
            await tx.conn.execute(
                "INSERT INTO preemption.preemptions(preemption_id, victim, preemptor, reason, queue, victim_queue, "
                "gpus, state, requested_at, deadline, estimated_lost_gpu_seconds) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, 'checkpointing', $8, $9, $10)",
                pid, victim_id, preemptor, payload.reason.value, queue, victim.queue, victim.gpus, tx.now,
                deadline, victim.lost_gpu_seconds(tx.now))
            await tx.conn.execute("UPDATE preemption.jobs SET status = 'preempting' WHERE job_id = $1", victim_id)
            if victim.checkpointable and config.policy.checkpoint_grace_s > 0:
                await tx.emit(CheckpointRequested(job_id=victim_id, preemption_id=pid,
                                                  deadline=utcnow_from(deadline)))
            else:
                await self._finish(tx, pid, victim_id, checkpoint_uri=None, checkpointed_at=None, step=None)

    async def on_checkpointed(self, tx: Tx, event: CloudEvent, payload: JobCheckpointed) -> None:
        at = payload.checkpointed_at.timestamp()
        await tx.conn.execute(
            "UPDATE preemption.jobs SET last_checkpoint_at = $2, last_checkpoint_uri = $3 WHERE job_id = $1 "
            "AND (last_checkpoint_at IS NULL OR last_checkpoint_at <= $2)", payload.job_id, at, payload.uri)
        open_row = await tx.conn.fetchrow(
            "SELECT preemption_id FROM preemption.preemptions WHERE victim = $1 AND state = 'checkpointing'",
            payload.job_id)
        if open_row is None:
            return  # a periodic checkpoint, or one that arrives after the grace: recorded above, nothing more
        if payload.preemption_id is not None and payload.preemption_id != open_row["preemption_id"]:
            return  # answers an older, aborted protocol: this one still waits for its own
        await self._finish(tx, open_row["preemption_id"], payload.job_id, checkpoint_uri=payload.uri,
                           checkpointed_at=at, step=payload.step)

    async def _finish(self, tx: Tx, pid: str, victim: str, *, checkpoint_uri: str | None,
                      checkpointed_at: float | None, step: int | None) -> None:
        """checkpointing -> preempted, at most once (guarded update), then JobPreempted."""
        job = await tx.conn.fetchrow(
            "SELECT started_at, placed_at, last_checkpoint_at, last_checkpoint_uri, spec->>'team' AS team "
            "FROM preemption.jobs "
            "WHERE job_id = $1", victim)
        started = tx.now
        if job is not None:
            started = job["started_at"] if job["started_at"] is not None else (job["placed_at"] or tx.now)
        marks = [started, checkpointed_at, job["last_checkpoint_at"] if job is not None else None]
        since = max(t for t in marks if t is not None)  # work after the newest checkpoint of this run is lost
        if checkpoint_uri is None and job is not None and job["last_checkpoint_at"] is not None \
                and job["last_checkpoint_at"] >= started:
            checkpoint_uri = job["last_checkpoint_uri"]  # resume from the last periodic checkpoint of this run
        row = await tx.conn.fetchrow(
            "UPDATE preemption.preemptions SET state = 'preempted', preempted_at = $3, checkpointed_at = $4, "
            "checkpoint_uri = $5, checkpoint_step = $6, lost_gpu_seconds = gpus * greatest(0, $3 - $7::float8) "
            "WHERE preemption_id = $1 AND victim = $2 AND state = 'checkpointing' "
            "RETURNING preemptor, reason, lost_gpu_seconds", pid, victim, tx.now, checkpointed_at,
            checkpoint_uri, step, float(since))
        if row is None:
            return
        await tx.conn.execute("UPDATE preemption.jobs SET status = 'preempted', last_preempted_at = $2, "
                              "bindings = NULL WHERE job_id = $1", victim, tx.now)
        await audit.record(tx, "preempt", service_actor("preemption"), job_id=victim,
                           team=job["team"] if job is not None else None, preemptor=row["preemptor"],
                           reason=row["reason"], preemption_id=pid, lost_gpu_seconds=float(row["lost_gpu_seconds"]))
        await tx.emit(JobPreempted(job_id=victim, reason=PreemptionReason(row["reason"]), preemptor=row["preemptor"],
                                   preemption_id=pid, lost_gpu_seconds=float(row["lost_gpu_seconds"]),
                                   checkpoint_uri=checkpoint_uri, preempted_at=utcnow_from(tx.now)))

    # ------------------------------------------------------------------ deadlines

    async def deadline_loop(self, runtime: ServiceRuntime) -> None:
        while True:
            await self.expire_due(runtime)
            await self.retry_deferred(runtime)
            await asyncio.sleep(self.tick_s)

    async def expire_due(self, runtime: ServiceRuntime) -> int:
        """Preempt every victim whose checkpoint grace elapsed on the runtime clock. Returns how many."""
        async with runtime.transaction() as tx:
            rows = await tx.conn.fetch(
                "SELECT preemption_id, victim FROM preemption.preemptions WHERE state = 'checkpointing' "
                "AND deadline <= $1 ORDER BY deadline, victim FOR UPDATE SKIP LOCKED", tx.now)
            for r in rows:
                await self._finish(tx, r["preemption_id"], r["victim"], checkpoint_uri=None, checkpointed_at=None,
                                   step=None)
        return len(rows)


    async def retry_deferred(self, runtime: ServiceRuntime) -> int:
        """Re-run every deferred request whose retry time came on the runtime clock. Returns how many.

        Each retry is a new protocol `<original id>/retry-<n>` (deterministic, so a crash before commit re-runs
        the same id); the row is deleted in the same transaction and re-inserted if protection still blocks."""
        async with runtime.transaction() as tx:
            rows = await tx.conn.fetch(
                "DELETE FROM preemption.deferred WHERE preemptor IN (SELECT preemptor FROM preemption.deferred "
                "WHERE retry_at <= $1 ORDER BY retry_at, preemptor FOR UPDATE SKIP LOCKED) "
                "RETURNING preemptor, preemption_id, attempt, payload, retry_at", tx.now)
            for r in sorted(rows, key=lambda r: (r["retry_at"], r["preemptor"])):
                payload = PreemptionRequested.model_validate_json(r["payload"])
                attempt = r["attempt"] + 1
                await self._run_request(tx, f"{r['preemption_id']}/retry-{attempt}", payload,
                                        origin=r["preemption_id"], attempt=attempt)
        return len(rows)


def build_spec(settings: StackSettings) -> ServiceSpec:
    """Entry point used by services/stack.py."""
    return PreemptionService(settings.queues).spec()
