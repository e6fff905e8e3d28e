"""Idle reclaim and TTLs of interactive work, telemetry's side (docs/admission.md, "Interactive work"; issue 48).

Telemetry already receives every GPU's utilisation with the job it belongs to (UtilizationSampled from DCGM, the
source of the GpuqAllocatedGpuIdle alert) and knows which jobs run. `IdleReclaimer` feeds those samples to the pure
core (services/core/idle `IdleWatch`) and, every `check_s` of platform time, executes what it says is due under the
configuration in force (admission's read model), each in one transaction with its audit record:

- WARN: a `job.idle_warned` webhook to the team's subscriptions (JobIdleWarned, with the deadline), and the same
  fact on the bus, which the Kubernetes executor shows as a Warning Event `GpuIdle` on the workload;
- RECLAIM with action `requeue`: PreemptionRequested, reason IdleReclaim, preemptor `idle:<job>`, the job the only
  candidate: the preemption service checkpoints and requeues it (the checkpoint-before-preempt protocol; a class that
  is never preempted keeps running);
- RECLAIM with action `end`: a job that can checkpoint goes through the same protocol, and its cancel is asked once it
  is preempted (JobPreempted, reason IdleReclaim, with its checkpoint); one that cannot, and TTL: JobCancelRequested
  on the job's team's subject at once: admission ends it (Cancelled), the executor stops it.

The idle clocks are kept in `telemetry.idle_clocks` (each written with the samples that moved it, a warning or
reclaim with its decision), and loaded at start: after a restart a job's idle time and its warning go on from where
they were, and its reclaim comes when it was due.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import asyncpg

from services.admission import configmodel
from services.core.idle import Decision, DecisionKind, IdleWatch, RunningJob
from services.core.telemetry.records import JobPhase
from services.core.telemetry.state import TelemetryState
from services.telemetry.webhooks import store as webhooks
from shared import audit
from shared.audit import service_actor
from shared.config import QueuesConfig
from shared.events import (
    JobCancelled,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobIdleWarned,
    JobPreempted,
    Payload,
    PreemptionReason,
    PreemptionRequested,
    UtilizationSampled,
    make_event,
    utcnow_from,
)
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.telemetry")

IDLE_CHECK_S = 60.0  # platform time between looks
POLL_S = 0.5
ACTOR = service_actor("telemetry")
# What the loop reads of the service: its core and the lock that guards it (the service replaces its core when it
# reloads, so the loop asks each time).
StateSource = Callable[[], tuple[TelemetryState, threading.Lock]]


class IdleReclaimer:
    def __init__(self, config: QueuesConfig | None, check_s: float = IDLE_CHECK_S):
        self.watch: IdleWatch | None = IdleWatch(config) if config is not None else None
        self.check_s = check_s
        # jobs reclaimed with action `end` through a checkpoint: job -> (team, reason of the cancel to ask when they are
        # preempted). In memory: after a restart such a job stays requeued with its checkpoint (nothing is lost).
        self._ending: dict[str, tuple[str, str]] = {}
        self._loaded: list[tuple[str, dict[str, Any]]] = []

    async def on_job_event(self, tx: Tx, payload: Payload) -> None:
        """A job event telemetry consumed: a job reclaimed to be ended, preempted with its checkpoint now, gets its
        cancel asked (asked again if this event is handled again: a second cancel of an ended job changes nothing)."""
        ending = self._ending.get(getattr(payload, "job_id", ""))
        if isinstance(payload, JobPreempted) and payload.reason is PreemptionReason.IDLE and ending is not None:
            team, reason = ending
            await tx.emit(JobCancelRequested(job_id=payload.job_id, requested_by=ACTOR, reason=reason,
                                             requested_at=utcnow_from(tx.now)), subject_suffix=team)
        elif isinstance(payload, JobCancelled | JobCompleted | JobFailed):
            self._ending.pop(payload.job_id, None)

    def configure(self, config: QueuesConfig) -> None:
        if self.watch is None:
            self.watch = IdleWatch(config)
        else:
            self.watch.configure(config)
        self._apply_loaded()

    async def load(self, conn: asyncpg.Connection) -> None:
        """The clocks stored before a restart (kept until a configuration makes the watch, if none is yet)."""
        self._loaded = [(r["job_id"], json.loads(r["doc"]))
                        for r in await conn.fetch("SELECT job_id, doc FROM telemetry.idle_clocks ORDER BY job_id")]
        self._apply_loaded()

    def _apply_loaded(self) -> None:
        """Hand the loaded clocks to the watch, once there is one."""
        if self.watch is None:
            return
        for job_id, doc in self._loaded:
            self.watch.load_clock(job_id, doc)
        self._loaded = []

    def changes(self) -> list[tuple[str, dict[str, Any] | None]]:
        """The clocks changed since the last call, as they are now (None: gone); the caller holds the state's lock
        (the watch moves with the state's samples)."""
        if self.watch is None:
            return []
        return [(job_id, self.watch.clock_doc(job_id)) for job_id in self.watch.changed()]

    @staticmethod
    async def persist(conn: asyncpg.Connection, changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        """Write `changes`: a clock replaces only an older version of itself (the sample handlers and the check loop
        write concurrently), one that went is deleted."""
        gone = [job_id for job_id, doc in changes if doc is None]
        if gone:
            await conn.execute("DELETE FROM telemetry.idle_clocks WHERE job_id = ANY($1::text[])", gone)
        kept = [(job_id, doc) for job_id, doc in changes if doc is not None]
        if kept:
            await conn.execute(
                "INSERT INTO telemetry.idle_clocks(job_id, version, doc) SELECT j, v, d::jsonb FROM "
                "unnest($1::text[], $2::bigint[], $3::text[]) AS t(j, v, d) ON CONFLICT (job_id) DO UPDATE SET "
                "version = excluded.version, doc = excluded.doc WHERE telemetry.idle_clocks.version < excluded.version",
                [j for j, _ in kept], [int(d["version"]) for _, d in kept], [json.dumps(d) for _, d in kept])

    def sample(self, payload: UtilizationSampled, state: TelemetryState) -> None:
        """Feed one node's samples of running jobs to the watch (the caller holds the state's lock)."""
        if self.watch is None:
            return
        at = payload.sampled_at.timestamp()
        for s in payload.samples:
            job = _running(state, s.job_id) if s.job_id else None
            if job is not None:
                gpu = f"{payload.node}/{s.gpu_index}" + (f"/{s.gpu_instance}" if s.gpu_instance is not None else "")
                self.watch.sample(job, gpu, at, s.utilization_pct)

    def due(self, state: TelemetryState, now: float) -> list[Decision]:
        if self.watch is None:
            return []
        running = [j for j in (_running(state, job_id) for job_id in sorted(state.jobs)) if j is not None]
        return self.watch.due(running, now)

    async def execute(self, tx: Tx, decision: Decision, queue: str) -> None:
        """One decision, with its audit record, in `tx`."""
        d = decision
        if d.kind is DecisionKind.WARN:
            assert d.idle_since is not None and d.deadline is not None
            warned = JobIdleWarned(job_id=d.job_id, team=d.team, user=d.user, idle_since=utcnow_from(d.idle_since),
                                   deadline=utcnow_from(d.deadline), action=_action(d), message=d.message)
            event = make_event(warned, source="gpuq/telemetry", time=utcnow_from(tx.now))
            await webhooks.enqueue_many(tx.conn, [(event, d.team, tx.now)])
            await tx.emit(warned)  # the Kubernetes executor shows it on the workload (Warning Event GpuIdle)
            await audit.record(tx, "idle_warn", ACTOR, job_id=d.job_id, team=d.team, user=d.user, message=d.message,
                               deadline=warned.deadline.isoformat())
            return
        requeue = d.action.value == "requeue"
        if d.kind is DecisionKind.RECLAIM and (requeue or d.checkpoint):
            # through the checkpoint-before-preempt protocol; to end a job that can checkpoint, its cancel is asked
            # once it is preempted with its checkpoint (on_preempted)
            if not requeue:
                self._ending[d.job_id] = (d.team, f"{d.reason}: {d.message}")
            await tx.emit(PreemptionRequested(preemptor=f"idle:{d.job_id}", queue=queue, reason=PreemptionReason.IDLE,
                                              candidates=(d.job_id,), message=d.message))
            await audit.record(tx, "idle_reclaim", ACTOR, job_id=d.job_id, team=d.team, user=d.user,
                               reclaim_by="requeue" if requeue else "end", checkpoint=d.checkpoint,
                               message=d.message)
            return
        await tx.emit(JobCancelRequested(job_id=d.job_id, requested_by=ACTOR, reason=f"{d.reason}: {d.message}",
                                         requested_at=utcnow_from(tx.now)), subject_suffix=d.team)
        await audit.record(tx, "idle_reclaim" if d.kind is DecisionKind.RECLAIM else "ttl_expired", ACTOR,
                           job_id=d.job_id, team=d.team, user=d.user, reclaim_by="end", message=d.message)

    async def run(self, runtime: ServiceRuntime, state_of: StateSource) -> None:
        """The loop: every `check_s` of platform time, take the configuration in force and execute what is due."""
        last: float | None = None
        while True:
            now = runtime.clock.now()
            if last is None or now - last >= self.check_s:
                last = now
                await self.check(runtime, state_of, now)
            await asyncio.sleep(POLL_S)

    async def check(self, runtime: ServiceRuntime, state_of: StateSource, now: float) -> list[Decision]:
        async with runtime.pool.acquire() as conn:
            version = await configmodel.in_force(conn)
        if version is not None:
            self.configure(version.config)
        state, lock = state_of()
        with lock:
            decisions = self.due(state, now)
            queues = {d.job_id: (state.jobs[d.job_id].queue if d.job_id in state.jobs else "") for d in decisions}
            changes = self.changes()
        if not decisions and not changes:
            return []
        # each decision is written with the clock it moved (warned, reclaimed); the clocks of jobs no longer running
        # go with the first
        todo: list[Decision | None] = [*decisions] if decisions else [None]
        for d in todo:
            try:
                async with runtime.transaction() as tx:
                    if changes:
                        await self.persist(tx.conn, changes)
                        changes = []
                    if d is not None:
                        await self.execute(tx, d, queues[d.job_id])
            except BaseException:
                # not done: the job's clock starts again (warned again, never reclaimed sooner); the runtime restarts
                # the loop
                if self.watch is not None:
                    with lock:
                        self.watch.unwritten([job_id for job_id, _ in changes])
                        if d is not None:
                            self.watch.forget(d.job_id)
                raise
            if d is None:
                break
            log.info("telemetry: %s %s (%s): %s", d.kind.value, d.job_id, d.team, d.message)
        return decisions


def _action(d: Decision) -> str:
    return str(d.action.value)


def _running(state: TelemetryState, job_id: str) -> RunningJob | None:
    rec = state.jobs.get(job_id)
    if rec is None or rec.phase is not JobPhase.RUNNING or rec.spec is None or rec.started_at is None:
        return None
    return RunningJob(job_id=job_id, team=rec.team, kind=rec.spec.kind, started_at=rec.started_at,
                      user=rec.spec.user, can_checkpoint=rec.spec.checkpoint.supported)
