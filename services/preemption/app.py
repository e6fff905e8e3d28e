"""The preemption service: checkpoint before preempt, as a state machine persisted in the `preemption` schema.

  PreemptionRequested ──choose victims (pure core)──▶ per victim: row `checkpointing` + CheckpointRequested
  JobCheckpointed (or the deadline = requested + checkpoint_grace_s, checked by a background loop on the
  runtime clock) ──▶ row `preempted` + JobPreempted(reason, preemptor, lost GPU-seconds, checkpoint URI)
  The scheduler frees the GPUs on JobPreempted; admission requeues the victim (JobRequeued) to resume from
  the checkpoint, keeping its original submit time.

Victims are chosen by the decision loop's rule for one request (services/core/pipeline `choose_victims`: the
cool-down, victim selection, the protection window's retry time, the hourly limit), the rule the simulator and the
ETA's replay apply in the pass that found their preemptor unplaceable.

Exactly-once per victim: every transition is a guarded UPDATE (`WHERE state = 'checkpointing'`) and a
partial unique index allows one open protocol per job, so a restart of any service mid-protocol (events
redelivered, deadlines re-read from the table) neither loses the victim nor preempts it twice.
Victims that cannot checkpoint (spec.checkpoint.supported = false) are preempted at once: waiting for a
checkpoint that will never come would only delay the preemptor.

One owner per fact (docs/architecture.md): the running jobs (spec, bindings, placement, the executor-reported
start) are the scheduler's, read from its read model; a preemptor (spec, whether it still waits, its flavors) is
admission's, read from its read model; both when a request is decided, a checkpoint arrives or a deadline comes.
The service consumes no job event but JobCheckpointed: an open protocol whose victim no longer holds the run it
was opened for, or whose preemptor was placed or stopped waiting, is aborted when it is next looked at (the next
request, the victim's checkpoint, its deadline), before anything is preempted for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import asyncpg

from services.admission import readmodel as admission_view
from services.admission.follow import ConfigFollower
from services.core.pipeline import Choice, choose_victims
from services.core.preemption import (
    PRIORITY,
    RECLAIM,
    Outcome,
    Preemptor,
    drain_plan,
    priority_of,
)
from services.core.preemption.idle import idle_victims
from services.preemption import defrag
from services.preemption.store import Snapshot, last_checkpoints, load_snapshot, run_started
from services.scheduler import readmodel as scheduler_view
from services.scheduler.readmodel import PlacementFact
from shared import audit
from shared.audit import service_actor
from shared.config import QueuesConfig, StopPolicy
from shared.events import (
    CheckpointRequested,
    CloudEvent,
    JobCheckpointed,
    JobPreempted,
    PreemptionReason,
    PreemptionRequested,
    QueueConfigChanged,
    utcnow_from,
)
from shared.quota_keys import is_non_gpu
from shared.service import ServiceRuntime, ServiceSpec, Tx
from shared.timefmt import human_time

if TYPE_CHECKING:
    from services.stack import StackSettings

log = logging.getLogger("gpuq.preemption")
MIGRATIONS = Path(__file__).parent / "migrations"


# The open protocols (one row per victim), with what `_reconcile` checks against the owners' read models.
OPEN_PROTOCOLS = ("SELECT preemption_id, victim, preemptor, reason, victim_placed_at FROM preemption.preemptions "
                  "WHERE state = 'checkpointing'")


def _preemptor(config: QueuesConfig, fact: admission_view.AdmissionFact, payload: PreemptionRequested,
               waiting_since: float | None = None) -> Preemptor:
    """The pure core's view of the preemptor: admission's requests are about quota (`need`, and `own_need` for
    within-queue preemption); the scheduler's priority requests are about room on the nodes."""
    spec = fact.spec
    allowed = fact.allowed_models
    for_quota = payload.reason is PreemptionReason.RECLAIM or bool(payload.own_need)
    if for_quota and not allowed:
        # the GPU models of what it needs (cpu_milli, memory_mib, pods, pool/<name> name no model)
        allowed = tuple(sorted({r.split(":", 1)[0] for r in payload.need if not is_non_gpu(r)}))
    return Preemptor(job_id=spec.job_id, queue=spec.queue, priority=priority_of(config, spec)[0],
                     kind=spec.kind, spec=spec,
                     reason=RECLAIM if payload.reason is PreemptionReason.RECLAIM else PRIORITY,
                     allowed_models=allowed, need=dict(payload.need) if for_quota else {},
                     own_need=dict(payload.own_need), max_victim_priority=payload.max_victim_priority,
                     waiting_since=waiting_since if payload.reason is PreemptionReason.RECLAIM else None)


# When the preemptor's reclaim was first asked since its last reclaim that started (the decision loop's chooser
# keeps the same, `VictimChooser.reclaim_asked`): a reclaim may wait for cheaper victims only for borrowers that
# started before it, so the lender's guarantee (asked + window + grace) holds (services/core/preemption/select.py).
RECLAIM_ASKED_SINCE = (
    "SELECT min(requested_at) FROM preemption.requests WHERE preemptor = $1 AND reason = $2 AND requested_at > "
    "coalesce((SELECT max(requested_at) FROM preemption.requests WHERE preemptor = $1 AND outcome = $3), "
    "'-Infinity'::double precision)")


# Requests with no waiting job behind them (a drain, an idle reclaim): their protocols end with the victim only.
_NO_PREEMPTOR = frozenset({PreemptionReason.DRAIN.value, PreemptionReason.IDLE.value})


class PreemptionService:
    def __init__(self, config: QueuesConfig, *, tick_s: float = 0.2):
        # The queue configuration is admission's: this service runs on its version in force (services/admission/
        # follow.py) and keeps no copy; `config` (queues.yaml) serves until admission has recorded a version.
        self.follower = ConfigFollower("preemption", config)
        self.tick_s = tick_s

    @property
    def config(self) -> QueuesConfig:
        return self.follower.config

    def spec(self) -> ServiceSpec:
        return ServiceSpec(
            name="preemption", schema="preemption", migrations=MIGRATIONS, singleton=True,
            handlers={PreemptionRequested: self.on_requested, JobCheckpointed: self.on_checkpointed,
                      QueueConfigChanged: self.on_config_changed},
            on_start=self.load, background=(self.deadline_loop,),
            # Its memory (the version of the queue configuration it runs on) is read from admission's read model
            # and only moves forward: applying an event again changes nothing.
            optimistic_batches=True,
        )

    async def load(self, runtime: ServiceRuntime) -> None:
        await self.follower.start(runtime)

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        """Admission published a version: later decisions take it (policy, priority classes, stop policies)."""
        await self.follower.on_changed(tx, event, payload)

    # ------------------------------------------------------------------ open protocols and their owners' facts

    async def _reconcile(self, tx: Tx, rows: Sequence[asyncpg.Record]) -> list[tuple[asyncpg.Record, PlacementFact]]:
        """Abort the open protocols (rows of preemption.preemptions) that must not end in a preemption any more, as
        the owners know it now: the victim no longer holds the run the protocol was opened for (it ended, or runs
        again under a new placement: the scheduler's read model), or the preemptor was placed or no longer waits
        (admission's read model; a drain has no preemptor). Returns the others, each with its victim's placement."""
        if not rows:
            return []
        preemptor_ids = [r["preemptor"] for r in rows if r["reason"] not in _NO_PREEMPTOR]
        placed = {p.job_id: p for p in await scheduler_view.placements(
            tx.conn, [r["victim"] for r in rows] + preemptor_ids)}
        preemptors = await admission_view.jobs(tx.conn, preemptor_ids)
        kept: list[tuple[asyncpg.Record, PlacementFact]] = []
        for r in rows:
            victim = placed.get(r["victim"])
            why = None
            if victim is None:
                why = "victim ended (it holds no GPUs any more)"
            elif r["victim_placed_at"] is not None and victim.placed_at != r["victim_placed_at"]:
                why = "victim ended (it runs again under a new placement)"
            elif r["reason"] not in _NO_PREEMPTOR:
                if r["preemptor"] in placed:
                    why = "preemptor placed before the checkpoint"
                elif (fact := preemptors.get(r["preemptor"])) is None or fact.status not in admission_view.WAITING:
                    why = f"preemptor no longer waiting ({fact.status if fact is not None else 'unknown'})"
            if victim is not None and why is None:
                kept.append((r, victim))
            else:
                await tx.conn.execute(
                    "UPDATE preemption.preemptions SET state = 'aborted', abort_reason = $3 "
                    "WHERE preemption_id = $1 AND victim = $2 AND state = 'checkpointing'",
                    r["preemption_id"], r["victim"], why)
        return kept

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

        # open protocols that must not go on (victim ended, preemptor placed or gone) stop holding their victims
        await self._reconcile(tx, await tx.conn.fetch(OPEN_PROTOCOLS))
        if payload.reason is PreemptionReason.DRAIN:
            await self._drain(tx, pid, payload, origin=origin, attempt=attempt, record=record)
            return
        if payload.reason is PreemptionReason.IDLE:
            await self._idle(tx, pid, payload, record=record)
            return
        fact = await self._waiting_preemptor(tx, payload, record)
        if fact is None:
            return
        config = self.config
        snap = await load_snapshot(tx.conn, config)
        if payload.preemptor in snap.placements:
            await record(Outcome.NOT_WAITING, "the preemptor is placed")
            return
        spec = fact.spec
        # The guard rails' memory is this schema's: when the preemptor was itself last preempted (its cool-down),
        # and its queue's victims of the last hour (the hourly limit)
        last_preempted = await tx.conn.fetchval(
            "SELECT max(preempted_at) FROM preemption.preemptions WHERE victim = $1 AND state = 'preempted'",
            payload.preemptor)
        recent = [r["requested_at"] for r in await tx.conn.fetch(
            "SELECT requested_at FROM preemption.preemptions WHERE queue = $1 AND state <> 'aborted' "
            "AND requested_at > $2", spec.queue, tx.now - 3600.0)]
        if payload.reason is PreemptionReason.DEFRAGMENTATION:  # the scheduler's planned moves: all or none
            verdict = defrag.judge(config, spec, payload.candidates, snap, await defrag.recent_moves(
                tx.conn, config, tx.now), tx.now, gang_last_preempted=last_preempted, queue_recent=recent)
            await record(verdict.outcome, verdict.message, verdict.victims)
            if verdict.outcome == Outcome.STARTED:
                await self._start(tx, pid, payload, spec.job_id, spec.queue, verdict.victims, snap)
            return
        # The decision loop's rule for one request (services/core/pipeline: the simulator and the ETA's replay
        # choose their victims with it too)
        asked = await tx.conn.fetchval(RECLAIM_ASKED_SINCE, payload.preemptor, PreemptionReason.RECLAIM.value,
                                       Outcome.STARTED)
        preemptor = _preemptor(config, fact, payload, tx.now if asked is None else min(asked, tx.now))
        choice = choose_victims(preemptor, snap.running, snap.cluster, config, tx.now,
                                last_preempted=last_preempted, recent_victim_times=recent, busy=snap.busy)
        if choice.outcome == Outcome.STARTED:
            await record(Outcome.STARTED, f"{len(choice.victims)} victim(s), about "
                         f"{choice.lost_gpu_seconds:.0f} GPU-seconds of work at risk", choice.victims)
            await self._start(tx, pid, payload, spec.job_id, spec.queue, choice.victims, snap)
            return
        await self._not_started(tx, payload, choice, origin=origin, attempt=attempt, record=record)

    async def _waiting_preemptor(self, tx: Tx, payload: PreemptionRequested,
                                 record: Callable[..., Awaitable[None]]) -> admission_view.AdmissionFact | None:
        """Admission's fact of the preemptor when it may preempt now; None (the refusal recorded) when a protocol
        for it is already open or it does not wait."""
        if await tx.conn.fetchval("SELECT 1 FROM preemption.preemptions WHERE preemptor = $1 "
                                  "AND state = 'checkpointing' LIMIT 1", payload.preemptor):
            await record(Outcome.DUPLICATE, "a preemption for this job is already in progress")
            return None
        # The preemptor is admission's fact: it committed the job before any request about it was sent (its own in
        # the same transaction, the scheduler's after JobAdmitted), so an unknown preemptor is no waiting one.
        fact = await admission_view.job(tx.conn, payload.preemptor)
        if fact is None:
            await record(Outcome.NOT_WAITING, "admission has no record of the preemptor")
            return None
        if fact.status not in admission_view.WAITING:
            await record(Outcome.NOT_WAITING, f"the preemptor is {fact.status}")
            return None
        return fact

    async def _not_started(self, tx: Tx, payload: PreemptionRequested, choice: Choice, *, origin: str,
                           attempt: int, record: Callable[..., Awaitable[None]]) -> None:
        """Record why the request took no victim. One held back by the preemptor's cool-down (it was itself
        preempted lately: no cascades) or only by protection windows is deferred until that ends: admission sends a
        request once, and the lender's guarantee is "nominal quota back within the protection window"."""
        sel = choice.selection
        if choice.outcome == Outcome.COOLDOWN and choice.retry_at is not None:
            await record(Outcome.COOLDOWN, f"{choice.why}; retry at {human_time(choice.retry_at)}")
            await self._defer(tx, payload, origin, attempt, choice.retry_at)
        elif choice.outcome == Outcome.DEFERRED and choice.retry_at is not None and sel is not None:
            await record(Outcome.DEFERRED, f"{sel.why}: {sel.message}; retry at "
                         f"{human_time(choice.retry_at)} when protection ends")
            await self._defer(tx, payload, origin, attempt, choice.retry_at)
        elif choice.outcome == Outcome.RATE_LIMITED:
            await record(Outcome.RATE_LIMITED, choice.why, choice.victims)
        else:  # FITS, NO_VICTIMS
            await record(choice.outcome, f"{sel.why}: {sel.message}" if sel is not None else choice.why)

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
        if (q is None or q.stop_policy is not StopPolicy.HOLD_AND_DRAIN) and await self.follower.refresh(tx.conn):
            # Admission asks for a drain once it has recorded the version that holds the queue, but that version's
            # announcement travels on another stream and may not have reached this service yet: the version in
            # force (admission's read model, committed before the request) decides, not the one last heard of.
            config = self.config
            q = config.queue_map.get(payload.queue)
        if q is None or q.stop_policy is not StopPolicy.HOLD_AND_DRAIN:
            await record(Outcome.NO_VICTIMS, f"queue {payload.queue} is not HoldAndDrain (any more): nothing drained")
            return
        # The candidates admission names were placed before it heard of them (JobPlaced follows the scheduler's
        # commit), so the read model has them, or they have ended since: there is nothing to wait for.
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
        await self._start(tx, pid, payload, payload.preemptor, payload.queue, plan.victims, snap)

    async def _idle(self, tx: Tx, pid: str, payload: PreemptionRequested,
                    record: Callable[..., Awaitable[None]]) -> None:
        """Idle reclaim (core/idle.py): the idle job named as the candidate is checkpointed and requeued, unless a
        class that is never preempted keeps it running."""
        snap = await load_snapshot(tx.conn, self.config)
        victims, kept = idle_victims(payload.candidates, snap.running, snap.busy)
        why = ", ".join(f"{j} ({w})" for j, w in sorted(kept.items())) or "none"
        if not victims:
            await record(Outcome.NO_VICTIMS, f"idle reclaim: nothing to requeue; kept: {why}")
            return
        await record(Outcome.STARTED, f"idle reclaim requeues {', '.join(victims)}; kept: {why}", victims)
        await self._start(tx, pid, payload, payload.preemptor, payload.queue, victims, snap)

    async def _start(self, tx: Tx, pid: str, payload: PreemptionRequested, preemptor: str, queue: str,
                     victims: tuple[str, ...], snap: Snapshot) -> None:
        """Open the checkpoint-before-preempt protocol for each victim, for the run it is in now."""
        config = self.config
        deadline = tx.now + config.policy.checkpoint_grace_s
        by_id = {j.job_id: j for j in snap.running}
        for victim_id in victims:
            victim, placement = by_id[victim_id], snap.placements[victim_id]
            await tx.conn.execute(
                "INSERT INTO preemption.preemptions(preemption_id, victim, preemptor, reason, queue, victim_queue, "
                "gpus, state, requested_at, deadline, estimated_lost_gpu_seconds, victim_placed_at) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, 'checkpointing', $8, $9, $10, $11)",
                pid, victim_id, preemptor, payload.reason.value, queue, victim.queue, victim.gpus, tx.now,
                deadline, victim.lost_gpu_seconds(tx.now), placement.placed_at)
            if victim.checkpointable and config.policy.checkpoint_grace_s > 0:
                await tx.emit(CheckpointRequested(job_id=victim_id, preemption_id=pid,
                                                  deadline=utcnow_from(deadline)))
            else:
                await self._finish(tx, pid, victim_id, placement, checkpoint_uri=None, checkpointed_at=None,
                                   step=None)

    async def on_checkpointed(self, tx: Tx, event: CloudEvent, payload: JobCheckpointed) -> None:
        at = payload.checkpointed_at.timestamp()
        await tx.conn.execute(
            "INSERT INTO preemption.checkpoints(job_id, checkpointed_at, uri) VALUES ($1, $2, $3) "
            "ON CONFLICT (job_id) DO UPDATE SET checkpointed_at = excluded.checkpointed_at, uri = excluded.uri "
            "WHERE preemption.checkpoints.checkpointed_at <= excluded.checkpointed_at", payload.job_id, at, payload.uri)
        open_rows = await self._reconcile(tx, await tx.conn.fetch(
            f"{OPEN_PROTOCOLS} AND victim = $1", payload.job_id))
        if not open_rows:
            return  # a periodic checkpoint, one after the grace, or the protocol could not go on: recorded above
        row, placement = open_rows[0]
        if payload.preemption_id is not None and payload.preemption_id != row["preemption_id"]:
            return  # answers an older, aborted protocol: this one still waits for its own
        await self._finish(tx, row["preemption_id"], payload.job_id, placement, checkpoint_uri=payload.uri,
                           checkpointed_at=at, step=payload.step)

    async def _finish(self, tx: Tx, pid: str, victim: str, placement: PlacementFact, *, checkpoint_uri: str | None,
                      checkpointed_at: float | None, step: int | None) -> None:
        """checkpointing -> preempted, at most once (guarded update), then JobPreempted. `placement` is the victim's
        run, as the scheduler's read model has it now (the caller checked it is the protocol's)."""
        started = run_started(placement)
        last = (await last_checkpoints(tx.conn, [victim])).get(victim)
        last_at, last_uri = last if last is not None else (None, None)
        marks = [started, checkpointed_at, last_at]
        since = max(t for t in marks if t is not None)  # work after the newest checkpoint of this run is lost
        if checkpoint_uri is None and last_at is not None and last_at >= started:
            checkpoint_uri = last_uri  # resume from the last periodic checkpoint of this run
        row = await tx.conn.fetchrow(
            "UPDATE preemption.preemptions SET state = 'preempted', preempted_at = $3, checkpointed_at = $4, "
            "checkpoint_uri = $5, checkpoint_step = $6, lost_gpu_seconds = gpus * greatest(0, $3 - $7::float8) "
            "WHERE preemption_id = $1 AND victim = $2 AND state = 'checkpointing' "
            "RETURNING preemptor, reason, lost_gpu_seconds", pid, victim, tx.now, checkpointed_at,
            checkpoint_uri, step, float(since))
        if row is None:
            return
        await audit.record(tx, "preempt", service_actor("preemption"), job_id=victim, team=placement.spec.team,
                           preemptor=row["preemptor"], reason=row["reason"], preemption_id=pid,
                           lost_gpu_seconds=float(row["lost_gpu_seconds"]))
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
        """Preempt every victim whose checkpoint grace elapsed on the runtime clock (or abort its protocol if it can
        no longer go on: `_reconcile`). Returns how many protocols were due."""
        async with runtime.transaction() as tx:
            rows = await tx.conn.fetch(f"{OPEN_PROTOCOLS} AND deadline <= $1 ORDER BY deadline, victim "
                                       "FOR UPDATE SKIP LOCKED", tx.now)
            for r, placement in await self._reconcile(tx, rows):
                await self._finish(tx, r["preemption_id"], r["victim"], placement, checkpoint_uri=None,
                                   checkpointed_at=None, step=None)
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
