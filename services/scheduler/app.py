"""The scheduler service: owns the cluster's allocation state and runs the pure placement core.

Each handled event (inventory, admission, end of a job) updates the snapshot and runs one scheduling
cycle in the same transaction: placements are written and JobPlaced events emitted together, after a
fencing check that this instance still holds the leader term. A single active instance is guaranteed by
the leader lease; a standby takes over when the leader's lease connection goes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from services.pipeline.core import WaitingJob, place, priority_value
from services.preemption.core import priority_of
from services.scheduler.core import ClusterState, RunningJob
from services.scheduler.liveness import LivenessWatch
from shared import audit
from shared.audit import service_actor
from shared.config import QueuesConfig
from shared.domain import GpuBinding, JobSpec, NodeHealth, NodeSpec
from shared.events import (
    CloudEvent,
    ExecutorHeartbeat,
    JobAdmitted,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    NodeChanged,
    NodeInventory,
    PreemptionReason,
    PreemptionRequested,
    utcnow_from,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx

log = logging.getLogger("gpuq.scheduler")
MIGRATIONS = Path(__file__).parent / "migrations"


class SchedulerService:
    def __init__(self, *, backfill: bool = True, strategy: str = "binpack", queues: QueuesConfig | None = None,
                 liveness: LivenessWatch | None = None):
        self.backfill = backfill
        self.queues = queues  # priority classes: when set, unplaceable jobs may ask for preemption
        self.strategy = strategy
        self.cluster = ClusterState.from_nodes([], strategy=strategy)
        self.runtime: ServiceRuntime | None = None
        self._published: dict[str, tuple[str, str]] = {}
        self.liveness = liveness or LivenessWatch.from_env()  # placed jobs no executor reports fail as Lost

    def spec(self) -> ServiceSpec:
        return ServiceSpec(
            name="scheduler", schema="scheduler", migrations=MIGRATIONS, singleton=True,
            handlers={NodeInventory: self.on_inventory, NodeChanged: self.on_node_changed,
                      JobAdmitted: self.on_admitted, JobStarted: self.on_started, JobCompleted: self.on_finished,
                      JobFailed: self.on_finished, JobCancelled: self.on_finished, JobPreempted: self.on_finished,
                      JobRequeued: self.on_requeued, ExecutorHeartbeat: self.liveness.on_heartbeat},
            on_start=self.load, reload=self._rebuild, background=(self.liveness.loop,),
        )

    # ------------------------------------------------------------------ state

    async def load(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        async with runtime.pool.acquire() as conn:
            await self._rebuild(conn)

    async def _rebuild(self, conn: asyncpg.Connection) -> None:
        nodes = [NodeSpec.model_validate_json(r["spec"]) for r in
                 await conn.fetch("SELECT spec FROM scheduler.nodes WHERE NOT removed ORDER BY name")]
        cluster = ClusterState.from_nodes(nodes, strategy=self.strategy)
        for r in await conn.fetch("SELECT spec, bindings FROM scheduler.jobs WHERE status = 'placed' "
                                  "ORDER BY placed_at, job_id"):
            spec = JobSpec.model_validate_json(r["spec"])
            bindings = [GpuBinding.model_validate(b) for b in json.loads(r["bindings"])]
            try:
                cluster.commit(cluster.make_placement(spec, bindings))
            except Exception as exc:  # a node vanished while we were down: the executor reports the job's fate
                log.warning("could not restore placement of %s: %s", spec.job_id, exc)
        self.cluster = cluster
        self._published.clear()

    async def _then_cycle(self, tx: Tx, body: Callable[[], Awaitable[None]]) -> None:
        """Apply an event's change, then run one scheduling cycle in the same transaction: after this event, or
        once after the whole batch of events the unit of work handles (`Tx.after_events`). (If anything fails, the
        runtime rebuilds memory from the tables through `reload` before the next unit of work.)"""
        await body()
        await tx.after_events("scheduling-cycle", self.cycle)

    # ------------------------------------------------------------------ handlers

    async def on_inventory(self, tx: Tx, event: CloudEvent, payload: NodeInventory) -> None:
        async def body() -> None:
            for node in sorted(payload.nodes, key=lambda n: n.name):
                await self._upsert_node(tx, node)

        await self._then_cycle(tx, body)

    async def on_node_changed(self, tx: Tx, event: CloudEvent, payload: NodeChanged) -> None:
        async def body() -> None:
            if payload.change == "removed":
                await self._upsert_node(tx, payload.node.model_copy(update={"health": NodeHealth.FAILED}),
                                        removed=True)
            else:
                await self._upsert_node(tx, payload.node)

        await self._then_cycle(tx, body)

    async def _upsert_node(self, tx: Tx, node: NodeSpec, removed: bool = False) -> None:
        self.cluster.upsert_node(node)
        await tx.conn.execute(
            "INSERT INTO scheduler.nodes(name, spec, removed, updated_at) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, removed = excluded.removed, "
            "updated_at = excluded.updated_at", node.name, node.model_dump_json(), removed, tx.now)

    async def on_admitted(self, tx: Tx, event: CloudEvent, payload: JobAdmitted) -> None:
        async def body() -> None:
            if await tx.conn.fetchval("SELECT true FROM scheduler.cancelled WHERE job_id = $1", payload.job_id):
                log.info("not placing %s: it was cancelled before its admission reached the scheduler",
                         payload.job_id)
                return
            await tx.conn.execute(
                """INSERT INTO scheduler.jobs(job_id, spec, flavors, status, admitted_at)
                   VALUES ($1, $2, $3, 'waiting', $4)
                   ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, flavors = excluded.flavors,
                     status = 'waiting', admitted_at = excluded.admitted_at, bindings = NULL, placed_at = NULL
                   WHERE scheduler.jobs.status <> 'placed'""",
                payload.job_id, payload.spec.model_dump_json(), json.dumps(payload.flavors),
                payload.admitted_at.timestamp())

        await self._then_cycle(tx, body)

    async def on_requeued(self, tx: Tx, event: CloudEvent, payload: JobRequeued) -> None:
        # Remember where a preempted job resumes from; it is placed again once admission re-admits it.
        await tx.conn.execute("UPDATE scheduler.jobs SET resume_from = $2 WHERE job_id = $1",
                              payload.job_id, payload.resume_from)

    async def on_started(self, tx: Tx, event: CloudEvent, payload: JobStarted) -> None:
        # Expected end from the real start and the user's limit (never the true duration).
        await tx.conn.execute(
            "UPDATE scheduler.jobs SET expected_end = $2 + (spec->>'max_runtime_s')::double precision "
            "WHERE job_id = $1 AND status = 'placed'", payload.job_id, payload.started_at.timestamp())

    async def on_finished(self, tx: Tx, event: CloudEvent,
                          payload: JobCompleted | JobFailed | JobCancelled | JobPreempted) -> None:
        async def body() -> None:
            self.cluster.release(payload.job_id)
            self._published.pop(payload.job_id, None)
            await tx.conn.execute("UPDATE scheduler.jobs SET status = 'finished' WHERE job_id = $1",
                                  payload.job_id)
            if isinstance(payload, JobCancelled):  # terminal, even for a job whose admission is still on its way
                await tx.conn.execute("INSERT INTO scheduler.cancelled(job_id, at) VALUES ($1, $2) "
                                      "ON CONFLICT DO NOTHING", payload.job_id, tx.now)

        await self._then_cycle(tx, body)

    # ------------------------------------------------------------------ the cycle

    async def cycle(self, tx: Tx) -> None:
        waiting = await tx.conn.fetch(
            "SELECT job_id, spec, flavors, resume_from, admitted_at FROM scheduler.jobs WHERE status = 'waiting' "
            "ORDER BY admitted_at, job_id")
        if not waiting:
            return
        pending = [self._waiting_job(r) for r in waiting]
        resume = {r["job_id"]: r["resume_from"] for r in waiting}
        rows = await tx.conn.fetch(
            "SELECT job_id, spec, coalesce(expected_end, placed_at + (spec->>'max_runtime_s')::double precision)"
            " AS expected_end FROM scheduler.jobs WHERE status = 'placed' ORDER BY job_id")
        running = [RunningJob(job_id=r["job_id"], expected_end=r["expected_end"]) for r in rows]
        # The pipeline orders the admitted jobs, places them and says which ask for preemption.
        outcome = place(self.cluster, pending, running, tx.now, backfill=self.backfill,
                        lowest_preemptible_running=self._lowest_preemptible(rows))
        result = outcome.result
        asks = set(outcome.preemption_asks)
        if result.placed and self.runtime is not None and self.runtime.lease is not None:
            await self.runtime.lease.check_fence(tx.conn)
        term = self.runtime.lease.term if self.runtime is not None and self.runtime.lease is not None else None
        specs = {w.spec.job_id: w.spec for w in pending}
        for placement in result.placed:
            spec = specs[placement.job_id]
            await tx.conn.execute(
                "UPDATE scheduler.jobs SET status = 'placed', placed_at = $2, bindings = $3, racks_spanned = $4, "
                "blocks_spanned = $5, fencing_token = $6, reason = NULL, message = NULL, planned_start = NULL, "
                "expected_end = $2::double precision + $7::double precision WHERE job_id = $1",
                placement.job_id, tx.now, json.dumps([b.model_dump(mode="json") for b in placement.bindings]),
                placement.racks_spanned, placement.blocks_spanned, term, float(spec.max_runtime_s))
            self._published.pop(placement.job_id, None)
            await audit.record(tx, "place", service_actor("scheduler"), job_id=placement.job_id, team=spec.team,
                               nodes=sorted({b.node for b in placement.bindings}), gpus=spec.total_gpus,
                               fencing_token=term)
            await tx.emit(JobPlaced(job_id=placement.job_id, spec=spec, bindings=placement.bindings,
                                    racks_spanned=placement.racks_spanned, blocks_spanned=placement.blocks_spanned,
                                    placed_at=utcnow_from(tx.now), fencing_token=term,
                                    resume_from=resume.get(placement.job_id)))
        for u in result.unplaceable:
            planned = result.reservations.get(u.job_id)
            await tx.conn.execute(
                "UPDATE scheduler.jobs SET reason = $2, message = $3, planned_start = $4 WHERE job_id = $1",
                u.job_id, u.reason, u.message, planned)
            if self._published.get(u.job_id) == (u.reason, u.message):
                continue
            self._published[u.job_id] = (u.reason, u.message)
            await tx.emit(JobPending(job_id=u.job_id, queue=specs[u.job_id].queue, stage="placement",
                                     reason=u.reason, message=u.message,
                                     eta=utcnow_from(planned) if planned is not None else None))
            if u.job_id in asks:  # sent when its pending reason changes, not every cycle
                spec = specs[u.job_id]
                await tx.emit(PreemptionRequested(
                    preemptor=spec.job_id, queue=spec.queue, reason=PreemptionReason.PRIORITY,
                    need={m: spec.total_gpus for m in spec.gpu_models} or {"gpus": spec.total_gpus},
                    message=f"{spec.job_id} ({spec.priority_class}) cannot be placed: {u.reason}"))

    def _waiting_job(self, row: asyncpg.Record) -> WaitingJob:
        spec = JobSpec.model_validate_json(row["spec"])
        return WaitingJob(spec=spec, allowed_models=tuple(sorted(set(json.loads(row["flavors"]).values()))),
                          priority=priority_value(self.queues, spec) if self.queues is not None else 0,
                          admitted_at=float(row["admitted_at"]))

    def _lowest_preemptible(self, placed: list[asyncpg.Record]) -> int | None:
        """The lowest priority of a running preemptible job (None: none, or no queue configuration to judge)."""
        if self.queues is None:
            return None
        values = []
        for r in placed:
            value, preemptible, _ = priority_of(self.queues, JobSpec.model_validate_json(r["spec"]))
            if preemptible:
                values.append(value)
        return min(values, default=None)
