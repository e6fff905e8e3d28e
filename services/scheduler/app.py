"""The scheduler service: owns the cluster's node facts and allocation state and runs the pure placement core.

It is their one owner: other services read them through its read model (readmodel.py, the views
`scheduler.v1_nodes` and `scheduler.v1_placements`), never through a copy of their own.

Each handled event (inventory, admission, end of a job) updates the snapshot and runs one scheduling
cycle in the same transaction: placements are written and JobPlaced events emitted together, after a
fencing check that this instance still holds the leader term. A single active instance is guaranteed by
the leader lease; a standby takes over when the leader's lease connection goes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import asyncpg

from services.admission.follow import ConfigFollower
from services.core.pipeline import PlacementBook, WaitingJob, hold_until, place_ordered, priority_value
from services.core.preemption import priority_of
from services.core.scheduler import ClusterState, CycleResult, Hold, Placement
from services.scheduler import defrag, held
from services.scheduler import elastic as el
from services.scheduler.liveness import LivenessWatch
from services.scheduler.nodes import MIGRATIONS, record_node
from shared import audit
from shared.audit import service_actor
from shared.config import QueuesConfig, placement_strategies
from shared.domain import GpuBinding, JobSpec, NodeHealth, NodeSpec
from shared.events import (
    CloudEvent,
    ExecutorHeartbeat,
    JobAdmitted,
    JobAttemptFailed,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobResizeAdmitted,
    JobStarted,
    NodeChanged,
    NodeInventory,
    PreemptionReason,
    PreemptionRequested,
    QueueConfigChanged,
    utcnow_from,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx

log = logging.getLogger("gpuq.scheduler")

# The capacity freed by a preemption is held for its preemptor until `hold_until` (the queues' checkpoint grace),
# DEFAULT_GRACE_S standing for the grace without a queue configuration. HOLDS_CHECK_S: wall seconds between looks
# for an expired hold.
DEFAULT_GRACE_S = 300.0
HOLDS_CHECK_S = 1.0


def _hold(row: asyncpg.Record) -> Hold:
    """A hold as scheduler.holds keeps it (the victim's bindings and requests are all the placement core reads)."""
    bindings = tuple(GpuBinding.model_validate(b) for b in json.loads(row["bindings"]))
    requests = tuple((int(c), int(m)) for c, m in json.loads(row["requests"]))
    placement = Placement(job_id=row["victim"], bindings=bindings, racks_spanned=0, blocks_spanned=0,
                          gpus=sum(len(b.gpu_indices) for b in bindings),
                          mig_slices=sum(1 for b in bindings if b.mig_slice is not None), requests=requests)
    return Hold(preemptor=row["preemptor"], victim=row["victim"], placement=placement, until=float(row["until"]))


class SchedulerService:
    def __init__(self, *, backfill: bool = True, strategy: str = "binpack", queues: QueuesConfig | None = None,
                 liveness: LivenessWatch | None = None):
        self.backfill = backfill
        # Priority classes: with a configuration, unplaceable jobs may ask for preemption. It follows admission's
        # version in force (services/admission/follow.py); `queues` serves until a version is recorded.
        self.follower = ConfigFollower("scheduler", queues) if queues is not None else None
        self.strategy = strategy
        self.cluster = ClusterState.from_nodes([], strategy=strategy)
        self.runtime: ServiceRuntime | None = None
        self._published: dict[str, tuple[str, str]] = {}
        self.liveness = liveness or LivenessWatch.from_env()  # placed jobs no executor reports fail as Lost
        # The service's state in memory, so that a cycle reads no table: the jobs waiting for placement in the
        # pipeline's order and the placed ones on their timeline of expected ends (`book`, kept up to date by each
        # event: a cycle sorts neither again), where a requeued job resumes from, and what the table says of each
        # waiting job's reason (rows are written only when it changes). Rebuilt from the tables at start and after a
        # failed unit of work (`_rebuild`).
        self.book = PlacementBook()
        self.resume: dict[str, str | None] = {}
        self.reasons: dict[str, tuple[str | None, str | None, float | None]] = {}
        self.limits: dict[str, float] = {}  # placed job -> its spec's max_runtime_s (its expected end after a start)
        # victim -> the capacity its preemption freed, held for its preemptor (docs/preemption.md, "The freed
        # GPUs go to the preemptor"); the table scheduler.holds is its durable copy
        self.holds: dict[str, Hold] = {}
        # the placed jobs' queues and the placed elastic jobs, which grow and shrink while they run (elastic.py)
        self.elastic = el.ElasticJobs()

    def spec(self) -> ServiceSpec:
        return ServiceSpec(
            name="scheduler", schema="scheduler", migrations=MIGRATIONS, singleton=True,
            handlers={NodeInventory: self.on_inventory, NodeChanged: self.on_node_changed,
                      JobAdmitted: self.on_admitted, JobStarted: self.on_started, JobCompleted: self.on_finished,
                      JobFailed: self.on_finished, JobAttemptFailed: self.on_finished, JobCancelled: self.on_finished,
                      JobPreempted: self.on_finished,
                      JobRequeued: self.on_requeued, JobResizeAdmitted: self.on_resize_admitted,
                      ExecutorHeartbeat: self.liveness.on_heartbeat,
                      **({QueueConfigChanged: self.on_config_changed} if self.follower is not None else {})},
            on_start=self.load, reload=self._rebuild, background=(self.liveness.loop, self.holds_loop),
            optimistic_batches=True,
            prefetch=held.prefetch_admissions,
        )

    # ------------------------------------------------------------------ state

    @property
    def queues(self) -> QueuesConfig | None:
        return self.follower.config if self.follower is not None else None

    async def load(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        if self.follower is not None:
            await self.follower.start(runtime)
        async with runtime.pool.acquire() as conn:
            await self._rebuild(conn)

    async def _rebuild(self, conn: asyncpg.Connection) -> None:
        nodes = [NodeSpec.model_validate_json(r["spec"]) for r in
                 await conn.fetch("SELECT spec FROM scheduler.nodes WHERE NOT removed ORDER BY name")]
        # each queue's own placement strategy (queues.yaml), of the version in force
        cluster = ClusterState.from_nodes(nodes, strategy=self.strategy,
                                          queue_strategies=placement_strategies(self.queues))
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
        self.book.clear()
        self.resume.clear()
        self.reasons.clear()
        self.limits.clear()
        self.elastic.clear()
        self.holds = {r["victim"]: _hold(r) for r in await conn.fetch(
            "SELECT victim, preemptor, bindings, requests, until FROM scheduler.holds ORDER BY victim")}
        for r in await conn.fetch(
                "SELECT job_id, spec, flavors, resume_from, admitted_at, reason, message, planned_start "
                "FROM scheduler.jobs WHERE status = 'waiting'"):
            self.book.wait(self._waiting_job(JobSpec.model_validate_json(r["spec"]), json.loads(r["flavors"]),
                                             float(r["admitted_at"])))
            self.resume[r["job_id"]] = r["resume_from"]
            self.reasons[r["job_id"]] = (r["reason"], r["message"], r["planned_start"])
        for r in await conn.fetch(
                "SELECT job_id, spec, flavors, grow_requested, "
                "coalesce(expected_end, placed_at + (spec->>'max_runtime_s')::double precision)"
                " AS expected_end FROM scheduler.jobs WHERE status = 'placed'"):
            spec = JobSpec.model_validate_json(r["spec"])
            self.elastic.placed(self._waiting_job(spec, json.loads(r["flavors"]), 0.0))
            if r["grow_requested"] is not None:
                self.elastic.asked[r["job_id"]] = int(r["grow_requested"])
            self.book.add_placed(r["job_id"], float(r["expected_end"]), self._preemptible_priority(spec))
            self.limits[r["job_id"]] = float(spec.max_runtime_s)

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
                                        removed=True, reason=payload.reason, message=payload.message)
            else:
                await self._upsert_node(tx, payload.node, reason=payload.reason, message=payload.message)

        await self._then_cycle(tx, body)

    async def _upsert_node(self, tx: Tx, node: NodeSpec, removed: bool = False, reason: str | None = None,
                           message: str = "") -> None:
        """scheduler.nodes is the cluster's one node table: other services read it through the read model
        (services/scheduler/readmodel.py), so why a node's health changed is kept there too."""
        self.cluster.upsert_node(node)
        await record_node(tx.conn, node, at=tx.now, removed=removed, reason=reason, message=message)

    async def on_admitted(self, tx: Tx, event: CloudEvent, payload: JobAdmitted) -> None:
        async def body() -> None:
            # The job waits unless it was cancelled first (a tombstone) or is placed already. In a consumed batch the
            # tombstone and row were read for all its admissions at once, and the row is written at its end
            # (services/scheduler/held.py).
            found = held.take(tx.scratch, payload.job_id)
            if found is None:
                await held.write_held(tx)
                found = (await held.read_admissions(tx.conn, [payload.job_id]))[payload.job_id]
            if found.cancelled:
                log.info("not placing %s: it was cancelled before its admission reached the scheduler",
                         payload.job_id)
                return
            if found.status == "placed":
                return  # a placed job's late re-admission changes nothing
            await held.record(tx, lambda rows: rows.admit(payload))
            self.book.wait(self._waiting_job(payload.spec, payload.flavors, payload.admitted_at.timestamp()))
            self.resume[payload.job_id] = found.resume_from
            self.reasons[payload.job_id] = (found.reason, found.message, found.planned_start)

        await self._then_cycle(tx, body)

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        """Admission published a version: the waiting and placed jobs take its priority classes (memory rebuilt from
        the tables, after this batch's held rows are written), then a cycle runs under it."""
        assert self.follower is not None
        if not await self.follower.on_changed(tx, event, payload):
            return

        async def body() -> None:
            await held.write_held(tx)
            await self._rebuild(tx.conn)

        await self._then_cycle(tx, body)

    async def on_requeued(self, tx: Tx, event: CloudEvent, payload: JobRequeued) -> None:
        # Remember where a preempted job resumes from; it is placed again once admission re-admits it.
        await held.write_held(tx)
        await tx.conn.execute("UPDATE scheduler.jobs SET resume_from = $2 WHERE job_id = $1",
                              payload.job_id, payload.resume_from)
        if payload.job_id in self.book.waiting:
            self.resume[payload.job_id] = payload.resume_from

    async def on_started(self, tx: Tx, event: CloudEvent, payload: JobStarted) -> None:
        # Expected end from the real start and the user's limit (never the true duration); the start itself is
        # part of the placement fact (read model `started_at`: preemption's protection window counts from it).
        # Only a placed job's row changes, and memory knows which are placed (the table's rows are memory's).
        limit = self.limits.get(payload.job_id)
        if payload.job_id not in self.book.placed or limit is None:
            return
        started_at = payload.started_at.timestamp()
        await held.record(tx, lambda rows: rows.start(payload.job_id, started_at))
        self.book.move_end(payload.job_id, started_at + limit)

    async def on_finished(self, tx: Tx, event: CloudEvent,
                          payload: JobCompleted | JobFailed | JobCancelled | JobPreempted | JobAttemptFailed) -> None:
        async def body() -> None:
            if isinstance(payload, JobPreempted):
                await self._hold_for_preemptor(tx, payload)
            await self._drop_holds(tx, [h for h in self.holds.values() if h.preemptor == payload.job_id])
            if isinstance(payload, JobPreempted) and (hint := await defrag.hold_hint(tx, payload, self.queues)):
                self.holds[hint["victim"]] = _hold(hint)  # a job moved by defragmentation: its hint held for it
            self.cluster.release(payload.job_id)
            self._published.pop(payload.job_id, None)
            self.book.forget(payload.job_id)
            self.resume.pop(payload.job_id, None)
            self.reasons.pop(payload.job_id, None)
            self.limits.pop(payload.job_id, None)
            await el.forget(tx, self.elastic, payload.job_id)
            # terminal, even for a job whose admission is still on its way: a tombstone
            cancelled_at = tx.now if isinstance(payload, JobCancelled) else None
            await held.record(tx, lambda rows: rows.finish(payload.job_id, cancelled_at))

        await self._then_cycle(tx, body)

    # ------------------------------------------------------------------ preemptors' holds

    async def _hold_for_preemptor(self, tx: Tx, payload: JobPreempted) -> None:
        """The victim's capacity is held for its preemptor until the preemptor is placed or ends, for at most the
        checkpoint grace from now: admission admits the preemptor only once this preemption released its quota, so
        without the hold this cycle gave the freed GPUs to another admitted job first in the order (another
        team's, in issue 51) and the preemptor waited for something unrelated to end. A drain and an idle reclaim
        have no preemptor; a preemptor already placed or ended needs nothing."""
        preemptor = payload.preemptor
        placement = self.cluster.placement_of(payload.job_id)
        if (not preemptor or payload.reason in (PreemptionReason.DRAIN, PreemptionReason.IDLE)
                or preemptor.startswith(("drain:", "idle:"))
                or placement is None or preemptor in self.book.placed):
            return
        await held.write_held(tx)  # (its own statement reads job rows: the batch's held ones first)
        ended = await tx.conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM scheduler.jobs WHERE job_id = $1 AND status = 'finished') "
            "OR EXISTS (SELECT 1 FROM scheduler.cancelled WHERE job_id = $1)", preemptor)
        if ended:
            return
        grace = float(self.queues.policy.checkpoint_grace_s) if self.queues is not None else DEFAULT_GRACE_S
        hold = Hold(preemptor=preemptor, victim=payload.job_id, placement=placement, until=hold_until(tx.now, grace))
        self.holds[hold.victim] = hold
        await tx.conn.execute(
            "INSERT INTO scheduler.holds(victim, preemptor, bindings, requests, until) VALUES ($1, $2, $3, $4, $5) "
            "ON CONFLICT (victim) DO UPDATE SET preemptor = excluded.preemptor, bindings = excluded.bindings, "
            "requests = excluded.requests, until = excluded.until",
            hold.victim, preemptor, json.dumps([b.model_dump(mode="json") for b in placement.bindings]),
            json.dumps([list(r) for r in placement.requests]), hold.until)

    async def _drop_holds(self, tx: Tx, holds: list[Hold]) -> None:
        if not holds:
            return
        for h in holds:
            self.holds.pop(h.victim, None)
        await tx.conn.execute("DELETE FROM scheduler.holds WHERE victim = ANY($1::text[])", [h.victim for h in holds])

    async def holds_loop(self, runtime: ServiceRuntime) -> None:
        """A hold that expires frees its capacity for the other waiting jobs: a cycle then, even if no event
        comes (the runtime clock decides; a second of wall time between looks)."""
        while True:
            await asyncio.sleep(HOLDS_CHECK_S)
            if not self.holds or min(h.until for h in self.holds.values()) > runtime.clock.now():
                continue
            async with runtime.transaction() as tx:
                await self.cycle(tx)

    # ------------------------------------------------------------------ the cycle

    async def cycle(self, tx: Tx) -> None:
        """One scheduling cycle over the in-memory state: no table is read, and nothing is sorted again (the book
        keeps the order and the timeline); the rows written are the placements (one statement for all of them) and
        the waiting jobs whose reason, message or planned start changed."""
        book = self.book
        # The batch's admissions, starts and ends first: the placements update their rows (the batch's own writer,
        # held.AFTER_EVENTS_KEY, runs before the cycle anyway; a cycle run from elsewhere must not depend on that).
        await held.write_held(tx)
        await self._drop_holds(tx, [h for h in self.holds.values() if h.until <= tx.now])
        if not book.waiting:
            await self._grow(tx)
            return
        # The pipeline places the waiting jobs in its order and says which ask for preemption; the capacity held
        # for preemptors goes to them only.
        outcome = place_ordered(self.cluster, book.pending, book.priority, book.timeline, tx.now,
                                backfill=self.backfill,
                                lowest_preemptible_running=book.lowest_preemptible if self.queues is not None else None,
                                # by victim, as loaded at start: the same holds give the same decisions after a restart
                                holds=[self.holds[v] for v in sorted(self.holds)])
        result = outcome.result
        donations = [] if self.holds else self.elastic.make_room(self.cluster, self.queues, result, book.waiting)
        asks = set(outcome.preemption_asks) - {p.job_id for p in result.placed}
        if result.placed and self.runtime is not None and self.runtime.lease is not None:
            await self.runtime.lease.check_fence(tx.conn)
        term = self.runtime.lease.term if self.runtime is not None and self.runtime.lease is not None else None
        await el.donated(tx, self.elastic, donations, term)  # shrunk before preemption (elastic.py)
        if result.placed:
            specs = [book.waiting[p.job_id].spec for p in result.placed]
            await tx.conn.execute(
                "UPDATE scheduler.jobs AS j SET status = 'placed', placed_at = $1, bindings = p.bindings::jsonb, "
                "racks_spanned = p.racks, blocks_spanned = p.blocks, fencing_token = $2, reason = NULL, "
                "message = NULL, planned_start = NULL, started_at = NULL, "
                "expected_end = $1::double precision + p.max_runtime_s "
                "FROM unnest($3::text[], $4::text[], $5::integer[], $6::integer[], $7::double precision[]) "
                "AS p(job_id, bindings, racks, blocks, max_runtime_s) WHERE j.job_id = p.job_id",
                tx.now, term, [p.job_id for p in result.placed],
                [json.dumps([b.model_dump(mode="json") for b in p.bindings]) for p in result.placed],
                [p.racks_spanned for p in result.placed], [p.blocks_spanned for p in result.placed],
                [float(spec.max_runtime_s) for spec in specs])
        if self.holds and result.placed:
            placed = {p.job_id for p in result.placed}
            await self._drop_holds(tx, [h for h in self.holds.values() if h.preemptor in placed])
        for placement in result.placed:
            spec = book.waiting[placement.job_id].spec
            self.elastic.placed(book.waiting[placement.job_id])
            resume_from = self.resume.pop(placement.job_id, None)
            book.unwait(placement.job_id)
            self.reasons.pop(placement.job_id, None)
            book.add_placed(placement.job_id, tx.now + float(spec.max_runtime_s), self._preemptible_priority(spec))
            self.limits[placement.job_id] = float(spec.max_runtime_s)
            self._published.pop(placement.job_id, None)
            await audit.record(tx, "place", service_actor("scheduler"), job_id=placement.job_id, team=spec.team,
                               nodes=sorted({b.node for b in placement.bindings}), gpus=spec.total_gpus,
                               fencing_token=term)
            await tx.emit(JobPlaced(job_id=placement.job_id, spec=spec, bindings=placement.bindings,
                                    racks_spanned=placement.racks_spanned, blocks_spanned=placement.blocks_spanned,
                                    placed_at=utcnow_from(tx.now), fencing_token=term, resume_from=resume_from))
        changed: list[tuple[str, str, str, float | None]] = []
        for u in result.unplaceable:
            planned = result.reservations.get(u.job_id)
            if self.reasons.get(u.job_id) != (u.reason, u.message, planned):
                self.reasons[u.job_id] = (u.reason, u.message, planned)
                changed.append((u.job_id, u.reason, u.message, planned))
            if self._published.get(u.job_id) == (u.reason, u.message):
                continue
            self._published[u.job_id] = (u.reason, u.message)
            spec = book.waiting[u.job_id].spec
            await tx.emit(JobPending(job_id=u.job_id, queue=spec.queue, stage="placement",
                                     reason=u.reason, message=u.message,
                                     eta=utcnow_from(planned) if planned is not None else None))
            if u.job_id in asks:  # sent when its pending reason changes, not every cycle
                await tx.emit(PreemptionRequested(
                    preemptor=spec.job_id, queue=spec.queue, reason=PreemptionReason.PRIORITY,
                    need={m: spec.total_gpus for m in spec.gpu_models} or {"gpus": spec.total_gpus},
                    message=f"{spec.job_id} ({spec.priority_class}) cannot be placed: {u.reason}"))
        if changed:
            await tx.conn.executemany(
                "UPDATE scheduler.jobs SET reason = $2, message = $3, planned_start = $4 WHERE job_id = $1", changed)
        self.holds.update(await defrag.ask_moves(tx, self.cluster, result, book.waiting, asks, self.queues, self.holds))
        await self._grow(tx, result)

    # ------------------------------------------------------------------ elastic jobs (elastic.py)

    async def _grow(self, tx: Tx, result: CycleResult | None = None) -> None:
        """Nothing waits for capacity (in `result`): a grow asked of admission (elastic.py); not past a hold."""
        if not self.holds and (result is None or not el.blocked(result)):
            await el.ask_grow(tx, self.elastic, self.cluster, self.queues)

    async def on_resize_admitted(self, tx: Tx, event: CloudEvent, payload: JobResizeAdmitted) -> None:
        async def body() -> None:
            await el.answered(tx, self.elastic, self.cluster, payload, self._fence)

        await self._then_cycle(tx, body)

    async def _fence(self, tx: Tx) -> int | None:
        """The leader term deciding now (its fence checked), None without a lease."""
        if self.runtime is None or self.runtime.lease is None:
            return None
        await self.runtime.lease.check_fence(tx.conn)
        return self.runtime.lease.term

    def _waiting_job(self, spec: JobSpec, flavors: dict[str, str], admitted_at: float) -> WaitingJob:
        return WaitingJob(spec=spec, allowed_models=tuple(sorted(set(flavors.values()))),
                          priority=priority_value(self.queues, spec) if self.queues is not None else 0,
                          admitted_at=admitted_at)

    def _preemptible_priority(self, spec: JobSpec) -> int | None:
        """The priority of a placed job that preemption may stop (None: not preemptible, or no queue configuration
        to judge): the lowest of them tells whether an unplaceable job may ask for preemption."""
        if self.queues is None:
            return None
        value, preemptible, _ = priority_of(self.queues, spec)
        return value if preemptible else None
