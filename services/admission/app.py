"""The admission service: a thin adapter between the bus, Postgres and the pure admission core.

Every handled event runs one admission cycle in the same transaction, so the jobs table, the quota
reservations and the emitted events (JobAdmitted, JobPending, JobRejected, PreemptionRequested) commit
together. The in-memory `AdmissionState` is rebuilt from the jobs table at start, and again whenever a
transaction fails after the state was touched, so memory never runs ahead of Postgres.

This module is the shell: the ServiceSpec, the units of work and their cycle, loading memory from the tables, and
the configuration's versions. The handlers' work is done by the parts it composes, which share one `Memory`
(memory.py): submission intake (intake.py), a job's later events and retry backoffs (lifecycle.py), the statuses
and preemption requests a cycle publishes (statuses.py), ETAs (etas.py), run-time history (history.py) and fair
share over time (usage.py).

Sharding (docs/admission.md, "Running several admission instances"): an instance serves all cohorts (the
default) or a set of them. A per-cohort instance leads per cohort, receives every event on its own durable
consumers, and handles only those of its cohorts' queues (`claim`); it keeps only their jobs in memory.
Every instance applies configuration changes; ownership always follows the configuration in force, which
changes only between units of work (a Postgres advisory lock), so no two instances act for the same queue.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import ValidationError

from services.admission import configmodel, prefetch, queuemodel
from services.admission.changecheck import check_proposal
from services.admission.elastic import ElasticCharges
from services.admission.etas import (  # re-exported: the ETA's injection point (services/stack.py) and tests
    ETA_DUTY_FACTOR,
    ETA_INTERVAL_S,
    EtaFn,
    EtaPublisher,
    EtaRange,
    cluster_view,
)
from services.admission.held import write_held
from services.admission.history import HISTORY_REBUILD_LIMIT, RAN_TO_THE_END, RunHistory
from services.admission.intake import SubmissionIntake
from services.admission.lifecycle import BACKOFF_REASON, BACKOFF_TICK_S, JobLifecycle
from services.admission.memory import Body, Memory, UnitOfWork
from services.admission.sharding import Shard
from services.admission.statuses import PreemptionRequester, StatusRows
from services.admission.usage import UsageHistory
from services.core.admission import AdmissionState, AdmittedWorkload, QueueFacts, Workload, queue_facts
from services.core.admission.configcheck import QueueJobs
from services.core.admission.statuses import PendingStatuses
from services.core.pipeline import admit
from shared import audit
from shared.audit import service_actor
from shared.config import ConfigError, QueuesConfig, parse_queues, queues_document, queues_hash
from shared.domain import JobSpec
from shared.events import (
    CloudEvent,
    JobAdmitted,
    JobApproved,
    JobAttemptFailed,
    JobCancelled,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobGrowRequested,
    JobPlaced,
    JobPreempted,
    JobResized,
    JobStarted,
    JobSubmitted,
    Payload,
    QueueConfigChanged,
    QueueUsageReported,
    utcnow_from,
)
from shared.health import CONFIG_STATE_KEY, ConfigInForce
from shared.leader import lock_key
from shared.service import Handler, ServiceRuntime, ServiceSpec, Tx

__all__ = ["BACKOFF_REASON", "BACKOFF_TICK_S", "CONFIG_LOCK", "ETA_DUTY_FACTOR", "ETA_INTERVAL_S", "ETA_IN_FORK",
           "HISTORY_REBUILD_LIMIT", "MIGRATIONS", "RAN_TO_THE_END", "AdmissionService", "EtaFn", "EtaRange",
           "cluster_view", "latest_config", "load_backoff", "load_expected_ends", "load_jobs", "load_state"]

log = logging.getLogger("gpuq.admission")
MIGRATIONS = Path(__file__).parent / "migrations"

# Replay ETAs in a forked child (shared/forked.py) rather than a worker thread, which shares the handlers' GIL: with
# 10,000 jobs waiting, the thread made the steady scenario's p99 submit->placed seconds long. (Read at each refresh,
# so that a test may switch it here.)
ETA_IN_FORK = True
# Held shared by a per-cohort instance's units of work and exclusively while a configuration is recorded.
CONFIG_LOCK = lock_key("admission-config")
# Events every per-cohort instance handles itself (see ServiceSpec.broadcast).
BROADCAST: frozenset[type[Payload]] = frozenset({QueueConfigChanged, QueueUsageReported})
FILE_PROPOSER = "file"  # who proposed a version recorded from a queues.yaml read at start


class AdmissionService:
    def __init__(self, config: QueuesConfig, eta: EtaFn | None = None, eta_interval_s: float = ETA_INTERVAL_S,
                 cohorts: Iterable[str] | None = None):
        self.initial_config = config
        self._file_hash = queues_hash(config)
        self.shard = Shard.of(cohorts)  # no cohorts = all cohorts: the single instance of old
        self._config_version: int | None = None  # admission.config version the state was loaded under
        self.memory = Memory.of(config)
        self.eta = eta
        # The queues' read model rows this instance last wrote (queuemodel.py), and under which configuration: a
        # cycle writes only the rows that changed. Cleared with memory when the runtime rebuilds it.
        self._queue_rows: dict[str, QueueFacts] = {}
        self._queue_rows_config: QueuesConfig | None = None
        # The parts, composed over the one memory. Bound methods are handed over, not the service: `self.cycle`
        # stays the one cycle every unit of work runs (a test may replace it on the instance).
        unit = UnitOfWork(then_cycle=self._then_cycle, cycle_and_count=self._cycle_and_count,
                          may_hold=self._may_hold)
        self.history = RunHistory(self.memory, eta)
        self.usage = UsageHistory(self.memory)
        self.statuses = StatusRows(self.memory)
        self.asks = PreemptionRequester(self.memory)
        self.intake = SubmissionIntake(self.memory, unit, self.history.predicted_gpu_s)
        self.lifecycle = JobLifecycle(self.memory, self.history, eta, self.shard, unit,
                                      drain_held_queues=self.asks.drain_held_queues,
                                      enter_config_epoch=self._enter_config_epoch)
        self.elastic = ElasticCharges(self.memory, unit)  # running elastic jobs' charges, grown and shrunk
        self.etas = None if eta is None else EtaPublisher(
            self.memory, eta, eta_interval_s, self.shard, enter_config_epoch=self._enter_config_epoch,
            in_fork=lambda: ETA_IN_FORK)

    # The core's state and the mirrors callers read (tests, benchmarks), kept in `memory`.
    @property
    def state(self) -> AdmissionState:
        return self.memory.state

    @state.setter
    def state(self, state: AdmissionState) -> None:
        self.memory.state = state

    @property
    def expected_end(self) -> dict[str, float]:
        return self.memory.expected_end

    @property
    def backoff(self) -> dict[str, float]:
        return self.memory.backoff

    def spec(self) -> ServiceSpec:
        sharded = not self.shard.serves_all
        lifecycle = self.lifecycle
        background = (lifecycle.backoff_loop,) if self.etas is None else (lifecycle.backoff_loop, self.etas.loop)
        return ServiceSpec(
            name="admission", schema="admission", migrations=MIGRATIONS, singleton=True,
            handlers={JobSubmitted: self.intake.on_submitted,
                      # these hold their row updates for the batch's end too, and read no row
                      JobCompleted: lifecycle.on_finished, JobFailed: lifecycle.on_finished,
                      JobPlaced: lifecycle.on_placed, JobStarted: lifecycle.on_started,
                      **{kind: _writing_held_first(handler) for kind, handler in (
                          (JobCancelRequested, lifecycle.on_cancel_requested), (JobApproved, lifecycle.on_approved),
                          (JobCancelled, lifecycle.on_cancelled), (JobPreempted, lifecycle.on_preempted),
                          (JobAttemptFailed, lifecycle.on_attempt_failed),
                          (QueueConfigChanged, self.on_config_changed),
                          (JobGrowRequested, self.elastic.on_grow_requested),
                          (JobResized, self.elastic.on_resized),
                          (QueueUsageReported, self.on_usage_reported))}},
            on_start=self.load, reload=self._rebuild, optimistic_batches=True,
            # (per-cohort instances write the same tables: a batch-start read could miss another's row)
            prefetch=None if sharded else prefetch.prefetch_submissions,
            background=background,
            consumer_suffix=self.shard.consumer_suffix, lease_scopes=self.shard.lease_scopes,
            shared_lease_scopes=self.shard.shared_lease_scopes, claim=self.claim if sharded else None,
            broadcast=BROADCAST if sharded else frozenset(),
        )

    def predicted_gpu_s(self, spec: JobSpec) -> float | None:
        """Duration-aware ordering: the job's predicted GPU-seconds (RunHistory.predicted_gpu_s)."""
        return self.history.predicted_gpu_s(spec)

    async def end_backoffs(self, tx: Tx) -> None:
        await self.lifecycle.end_backoffs(tx)

    async def publish_etas(self, tx: Tx, etas: Mapping[str, EtaRange] | None = None) -> None:
        assert self.etas is not None, "admission runs without an ETA function"
        await self.etas.publish(tx, etas)

    # ------------------------------------------------------------------ state

    async def load(self, runtime: ServiceRuntime) -> None:
        async with runtime.transaction() as tx:
            # Instances of several cohort sets (and a standby taking over) may start together with the same file:
            # its proposal is judged under the lock, so the same content is one version; and none loads its jobs
            # while a configuration change is being recorded.
            await tx.conn.execute("SELECT pg_advisory_xact_lock($1)", CONFIG_LOCK)
            await _fill_in_hashes(tx.conn)
            recorded = await self._propose_file(tx)
            await self._rebuild(tx.conn)
            await self.history.rebuild(tx.conn)
            if recorded:
                await self._cycle_and_count(tx)  # admit what the file's version made room for
            else:
                await self._publish_queues(tx)
        runtime.state[CONFIG_STATE_KEY] = self.config_report
        if self.shard.cohorts is not None:
            declared = {c.name for c in self.state.config.cohorts}
            unknown = sorted(self.shard.cohorts - declared - {"-"})
            if unknown:
                log.warning("admission serves cohorts the configuration does not declare (yet): %s",
                            ", ".join(unknown))
            log.info("admission serves %s: queues %s", self.shard.describe(),
                     ", ".join(self.shard.queues(self.state.config)) or "none")

    async def _rebuild(self, conn: asyncpg.Connection) -> None:
        memory = self.memory
        self._config_version, config = await latest_config(conn, self.initial_config)
        memory.state = await load_jobs(conn, config, self.shard)
        memory.backoff = await load_backoff(conn, config, self.shard)
        self.usage.apply()
        memory.expected_end = await load_expected_ends(conn)
        await self.elastic.load(conn)
        memory.clear_published()
        self._queue_rows.clear()  # what was written in a failed unit of work was rolled back with it
        self._queue_rows_config = None
        memory.changed()

    async def _propose_file(self, tx: Tx) -> bool:
        """The queues.yaml this instance started with is a proposed change (a helm upgrade changes the file and
        restarts the pods). It becomes the next version only if its content is not the version in force and was never
        recorded before: an earlier version's content is an old pod's file (a rolling upgrade, a restarted old
        replica) and must not roll the configuration back. The newest distinct file wins; returning to an earlier
        content is a change made on purpose, with `gpuq apply-queues` or the API. True when it was recorded."""
        current = await configmodel.in_force(tx.conn)
        if current is not None and current.hash == self._file_hash:
            log.info("queues.yaml is the queue configuration in force, %s", current.summary())
            await self._republish(tx, current)
            return False
        earlier = await configmodel.version_of(tx.conn, self._file_hash) if current is not None else None
        if current is not None and earlier is not None:
            log.warning("queues.yaml (%s) is version %d's content, older than %s in force: NOT applied (an old file, "
                        "as an old pod has in a rolling upgrade); admission runs on %s. To return to it, apply it "
                        "with gpuq apply-queues", self._file_hash[:12], earlier, current.summary(), current.summary())
            await self._audit_config(tx, "config_file_stale", service_actor("admission"), version=current.version,
                                     hash=current.hash, file_hash=self._file_hash, file_version=earlier)
            await self._republish(tx, current)
            return False
        version = await self._record_config(tx, self.initial_config, by=FILE_PROPOSER, source="file")
        await self._audit_config(tx, "config_applied", service_actor("admission"), version=version,
                                 hash=self._file_hash, source="file", replaced=current.version if current else None,
                                 warnings=self.initial_config.warnings())
        return True

    async def _record_config(self, tx: Tx, config: QueuesConfig, *, by: str, source: str,
                             event_id: str | None = None) -> int:
        """Record `config` as the next version, and publish it (QueueConfigChanged with its version and hash, in this
        transaction's outbox): the other services then read it from the read model (services/admission/
        configmodel.py). The caller holds CONFIG_LOCK exclusively."""
        document, content = queues_document(config), queues_hash(config)
        version = int(await tx.conn.fetchval(
            "INSERT INTO admission.config(applied_at, document, applied_by, event_id, hash, source) "
            "VALUES ($1, $2, $3, $4, $5, $6) RETURNING version",
            tx.now, json.dumps(document), by, event_id, content, source))
        await tx.emit(QueueConfigChanged(config=document, changed_by=by, config_version=version, config_hash=content))
        log.info("queue configuration version %d (%s) recorded, from %s by %s", version, content[:12], source, by)
        return version

    async def _republish(self, tx: Tx, current: configmodel.ConfigVersion) -> None:
        """The version in force, published again at start: a service that started before any version was readable
        (before admission's first start, or its migration in an upgrade) runs on its file until it hears of one."""
        await tx.emit(QueueConfigChanged(config=queues_document(current.config), changed_by=current.applied_by,
                                         config_version=current.version, config_hash=current.hash))

    async def _audit_config(self, tx: Tx, action: str, actor: str, **detail: Any) -> None:
        """A configuration decision, in admission's own audit table and as an audit record (the audit service)."""
        kept = {k: v for k, v in detail.items() if v is not None}
        await tx.conn.execute("INSERT INTO admission.audit(at, actor, action, detail) VALUES ($1, $2, $3, $4)",
                              tx.now, actor, action, json.dumps(kept))
        await audit.record(tx, action, actor, **kept)

    def config_report(self) -> ConfigInForce:
        """The version this instance runs on, for /readyz and gpuq_config_version."""
        content = queues_hash(self.state.config)
        differs = content != self._file_hash
        where = (f"version {self._config_version}" if self._config_version is not None
                 else "no version recorded yet: queues.yaml")
        return ConfigInForce(version=self._config_version, hash=content, file_differs=differs,
                             detail=where + (" (queues.yaml differs)" if differs else ""))

    async def _reload_owned(self, conn: asyncpg.Connection) -> None:
        """The configuration in force changed (here or in another instance): take this instance's queues under it
        from the tables. Memory and tables agree at this point, so what was published stays valid for the jobs
        kept; jobs that moved here get their status published by the next cycle."""
        memory = self.memory
        self._config_version, config = await latest_config(conn, self.initial_config)
        memory.state = await load_jobs(conn, config, self.shard)
        memory.backoff = await load_backoff(conn, config, self.shard)
        await self.elastic.load(conn)
        self.usage.apply()
        memory.keep_published_of(memory.state.pending.keys() | memory.state.admitted.keys())
        memory.changed()

    # ------------------------------------------------------------------ sharding (per-cohort instances only)

    async def _enter_config_epoch(self, conn: asyncpg.Connection, *, exclusive: bool = False) -> None:
        """Work under the configuration in force. A configuration is recorded holding CONFIG_LOCK exclusively,
        so it commits between units of work, never during one: every instance then decides ownership with the
        same configuration, and an instance taking over queues sees every write of their previous owner."""
        mode = "" if exclusive else "_shared"
        await conn.execute(f"SELECT pg_advisory_xact_lock{mode}($1)", CONFIG_LOCK)
        version = await conn.fetchval("SELECT max(version) FROM admission.config")
        if version != self._config_version:
            await self._reload_owned(conn)

    async def claim(self, conn: asyncpg.Connection, event: CloudEvent, payload: object) -> bool:
        """Is this event this instance's? (ServiceSpec.claim; per-cohort instances only.) Events of other
        cohorts' jobs are acked with nothing recorded (ETAs see their placements in the scheduler's read model)."""
        if isinstance(payload, QueueUsageReported):
            return True  # every instance applies usage to its queues
        await self._enter_config_epoch(conn, exclusive=isinstance(payload, QueueConfigChanged))
        if isinstance(payload, QueueConfigChanged):
            return True
        if isinstance(payload, JobSubmitted):
            # A queue the configuration does not declare belongs to "-": exactly one instance rejects the job.
            return self.shard.owns_queue(self.state.config, payload.spec.queue)
        job_id = payload.job_id  # type: ignore[attr-defined]  # every other claimed event is about one job
        if job_id in self.state.pending or job_id in self.state.admitted:
            return True
        if isinstance(payload, JobCancelRequested | JobApproved):
            # Also for jobs awaiting approval (not in the core's state) and jobs not known yet (a tombstone: any
            # instance may write it, the inbox keeps it to one).
            queue = await conn.fetchval("SELECT queue FROM admission.jobs WHERE job_id = $1", job_id)
            return queue is None or self.shard.owns_queue(self.state.config, queue)
        return False

    async def _then_cycle(self, tx: Tx, body: Body) -> None:
        """Apply an event's change, then run one admission cycle in the same transaction: after this event, or once
        after the whole batch of events the unit of work handles (`Tx.after_events`). (If anything fails, the
        runtime rebuilds memory from the tables through `reload` before the next unit of work.)"""
        await body()
        await tx.after_events("admission-cycle", self._cycle_and_count)

    def _may_hold(self, tx: Tx) -> bool:
        """May this unit of work hold row writes for the batch's end (services/admission/held.py)? Not in a savepoint
        of its own (a later message's failure could lose them with it), nor in a per-cohort instance, whose `claim`
        reads the table before a later message's handler runs."""
        return not tx.own_savepoint and self.shard.serves_all

    async def _cycle_and_count(self, tx: Tx) -> None:
        await write_held(tx)  # the cycle updates the rows of the jobs it admits
        await self.cycle(tx)
        await self._publish_queues(tx)
        self.memory.changed()

    async def _publish_queues(self, tx: Tx) -> None:
        """The queues' read model (queuemodel.py) in the unit of work's transaction: the rows of this instance's
        queues that changed; after a configuration change, the rows of queues no longer configured go."""
        config = self.state.config
        touched = self.state.take_touched()
        if config is self._queue_rows_config:
            if not touched:
                return
            # only the touched queues' rows (and their lending pools'): a deep backlog elsewhere is not walked
            facts, configured = queue_facts(self.state, touched), None
        else:
            facts, configured = queue_facts(self.state), [q.name for q in config.queues]
        owned = [f for f in facts if self.shard.owns_queue(config, f.queue)]
        self._queue_rows = await queuemodel.write(tx.conn, owned, self._queue_rows, configured)
        self._queue_rows_config = config

    # ------------------------------------------------------------------ the configuration

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        """A proposed change (gpuq apply-queues, the API): validated once, recorded as the next version unless its
        content is in force already, published, audited. A publication (with `config_version`: this service's own,
        or another instance's) is never applied from its content: the table says what is in force."""
        sharded = not self.shard.serves_all
        if payload.config_version is not None:
            # A per-cohort instance's `claim` moved it to the configuration in force already (a cycle admits what
            # that made room for); an all-cohorts instance moves now if another instance recorded it.
            if sharded:
                await self._then_cycle(tx, _nothing)
            elif await tx.conn.fetchval("SELECT max(version) FROM admission.config") != self._config_version:
                await self._then_cycle(tx, lambda: self._reload_owned(tx.conn))
            return
        if await _config_event_settled(tx, event, plain_inbox=sharded):
            # Another instance recorded (or refused) it, and this instance already runs under the configuration
            # in force (`claim` moved it there; an all-cohorts instance loaded it at start): never re-apply an
            # older change. A cycle admits what the change made room for here.
            await self._then_cycle(tx, _nothing)
            return
        try:
            config = parse_queues(payload.config, f"QueueConfigChanged {event.id}")
        except (ConfigError, ValidationError) as exc:
            # Refused: the old configuration keeps running; the refusal is audited with its reason.
            await self._audit_config(tx, "config_refused", payload.changed_by, error=str(exc), event_id=event.id)
            log.error("refused queue configuration change: %s", exc)
            return
        content = queues_hash(config)
        current = await configmodel.in_force(tx.conn)
        if current is not None and current.hash == content:
            # The content in force already (a command repeated, a file's content proposed again): no new version.
            await self._audit_config(tx, "config_unchanged", payload.changed_by, event_id=event.id,
                                     version=current.version, hash=content)
            return
        # Checked here, whatever path the proposal came by (a direct publish, the API, the CLI): a guarantee past
        # the live cluster's capacity, a GPU model it lacks, a queue removed under its jobs. Refused, like an
        # invalid document, unless forced; the verdict is audited either way, and nothing is retried (the check
        # reads committed facts, so a refusal is final and admission goes on with the old configuration).
        checked = await check_proposal(tx.conn, config, held=self._jobs_per_queue())
        if checked.refused and not payload.force:
            await self._audit_config(tx, "config_refused", payload.changed_by, error=checked.reason(),
                                     refusals=list(checked.refusals), event_id=event.id, hash=content)
            log.error("refused queue configuration change from %s: %s", payload.changed_by, checked.reason())
            return

        async def body() -> None:
            reorder = config.policy.duration_ordering != self.state.config.policy.duration_ordering
            messages = self.state.set_config(config)
            version = await self._record_config(tx, config, by=payload.changed_by, source="change", event_id=event.id)
            self._config_version = version
            detail: dict[str, Any] = {"messages": messages, "warnings": list(checked.warnings), "version": version,
                                      "hash": content, "source": "change", "event_id": event.id,
                                      "replaced": current.version if current is not None else None,
                                      "diff": list(checked.diff)}
            if payload.force:
                # who overrode which refusals is part of the record (None when forcing overrode nothing)
                detail["forced"] = True
                detail["overridden"] = list(checked.refusals) or None
            if reorder and not sharded:
                # duration ordering turned on or off: the jobs take (or drop) their stored predictions
                self.memory.state = await load_jobs(tx.conn, config, self.shard)
            self.usage.apply()  # the new configuration's quotas and half-life
            if sharded:
                # The messages are about this instance's jobs; a queue may now belong to another instance.
                detail["cohorts"] = sorted(self.shard.cohorts or ())
                await self._reload_owned(tx.conn)
            await self._audit_config(tx, "config_applied", payload.changed_by, **detail)

        await self._then_cycle(tx, body)

    def _jobs_per_queue(self) -> dict[str, QueueJobs]:
        """Pending and admitted jobs per queue in this instance's memory (rows of this batch may not be written
        yet: services/admission/held.py)."""
        pending: dict[str, int] = {}
        admitted: dict[str, int] = {}
        for w in self.state.pending.values():
            pending[w.spec.queue] = pending.get(w.spec.queue, 0) + 1
        for a in self.state.admitted.values():
            admitted[a.spec.queue] = admitted.get(a.spec.queue, 0) + 1
        return {q: QueueJobs(pending=pending.get(q, 0), admitted=admitted.get(q, 0))
                for q in pending.keys() | admitted.keys()}

    # ------------------------------------------------------------------ fair share over time

    async def on_usage_reported(self, tx: Tx, event: CloudEvent, payload: QueueUsageReported) -> None:
        """Metering's decayed usage per queue (policy.usage_half_life_s): the queues' historic standing changes,
        so a cycle runs. An older report than the one in force changes nothing (UsageHistory.reported)."""
        if not self.usage.reported(payload):
            return

        async def body() -> None:
            self.usage.apply()

        await self._then_cycle(tx, body)

    # ------------------------------------------------------------------ the cycle

    async def cycle(self, tx: Tx) -> None:
        decision = admit(self.state, tx.now)  # the pipeline's admission half: quota only
        await self._record_admissions(tx, decision.admitted)
        pending = decision.pending
        assert isinstance(pending, PendingStatuses)  # what admission_cycle always returns
        await self.statuses.publish(tx, pending)
        # pods above an elastic floor that keep a job out are asked back first; that cohort's reclaims wait for them
        await self.asks.request_reclaims(tx, await self.elastic.reclaims_after_give_back(tx, decision.reclaims))
        await self.asks.drain_held_queues(tx)

    async def _record_admissions(self, tx: Tx, admitted: list[AdmittedWorkload]) -> None:
        await self.elastic.reset(tx, (a.job_id for a in admitted if a.spec.elastic))
        if admitted:
            # the cycle's admissions in one statement (a burst's batch admits hundreds)
            await tx.conn.execute(
                "UPDATE admission.jobs AS j SET status = 'admitted', admitted_at = u.a, flavors = u.f::jsonb, "
                "usage = u.q::jsonb, borrowing = u.b, reason = NULL, message = NULL, position_in_queue = NULL, "
                "position_in_cohort = NULL FROM unnest($1::text[], $2::float8[], $3::text[], $4::text[], "
                "$5::bool[]) AS u(id, a, f, q, b) WHERE j.job_id = u.id",
                [a.job_id for a in admitted], [a.admitted_at for a in admitted],
                [json.dumps(a.flavors) for a in admitted], [json.dumps(a.usage) for a in admitted],
                [a.borrowing for a in admitted])
        for a in admitted:
            # its waiting status no longer holds (its ETA stays until it is placed: etas.py)
            self.memory.published.pop(a.job_id, None)
            self.memory.announced.pop(a.job_id, None)
            await audit.record(tx, "admit", service_actor("admission"), job_id=a.job_id, team=a.spec.team,
                               queue=a.spec.queue, quota=a.usage, borrowing=a.borrowing)
            await tx.emit(JobAdmitted(job_id=a.job_id, spec=a.spec, flavors=a.flavors, quota=a.usage,
                                      borrowing=a.borrowing, submitted_at=utcnow_from(a.submitted_at),
                                      admitted_at=utcnow_from(a.admitted_at)))


def _writing_held_first(handler: Handler) -> Handler:
    """`handler`, after writing the submissions held for the batch's end (services/admission/held.py): it reads and
    writes the jobs' rows, which must hold every job queued before its event."""

    async def run(tx: Tx, event: CloudEvent, payload: Any) -> None:
        await write_held(tx)
        await handler(tx, event, payload)

    return run


async def _nothing() -> None:
    return None


async def _config_event_settled(tx: Tx, event: CloudEvent, *, plain_inbox: bool) -> bool:
    """Was this QueueConfigChanged already recorded or refused by an admission instance? (Another instance, or an
    earlier one: a new cohort set's consumers read the stream from its start.) `plain_inbox`: per-cohort instances
    also look for the plain event id in the inbox, written by an all-cohorts instance that handled it before
    admission.config had event ids."""
    inbox = "OR EXISTS (SELECT 1 FROM admission.inbox WHERE event_id = $1) " if plain_inbox else ""
    return bool(await tx.conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM admission.config WHERE event_id = $1) " + inbox +
        "OR EXISTS (SELECT 1 FROM admission.audit WHERE action IN ('config_refused', 'config_unchanged') "
        "AND detail->>'event_id' = $1)",
        event.id))


async def _fill_in_hashes(conn: asyncpg.Connection) -> None:
    """Versions recorded before hashes were (migration 010) get theirs, so that an earlier version's file is
    recognised as one. Under CONFIG_LOCK, at start."""
    for r in await conn.fetch("SELECT version, document FROM admission.config WHERE hash IS NULL ORDER BY version"):
        content = queues_hash(parse_queues(json.loads(r["document"]), f"admission.config version {r['version']}"))
        await conn.execute("UPDATE admission.config SET hash = $2 WHERE version = $1", r["version"], content)


async def latest_config(conn: asyncpg.Connection,
                        fallback: QueuesConfig | None = None) -> tuple[int | None, QueuesConfig]:
    """The configuration in force and its admission.config version (None: nothing recorded, the fallback)."""
    row = await conn.fetchrow("SELECT version, document FROM admission.config ORDER BY version DESC LIMIT 1")
    if row is not None:
        return row["version"], parse_queues(json.loads(row["document"]), "admission.config")
    if fallback is not None:
        return None, fallback
    raise LookupError("admission has no queue configuration recorded yet")


async def load_state(conn: asyncpg.Connection, fallback: QueuesConfig | None = None) -> AdmissionState:
    """Rebuild the core's state from admission's tables: the configuration in force, pending and admitted jobs."""
    _, config = await latest_config(conn, fallback)
    return await load_jobs(conn, config)


async def load_jobs(conn: asyncpg.Connection, config: QueuesConfig, shard: Shard | None = None) -> AdmissionState:
    """The core's state under `config` with the pending and admitted jobs of the queues `shard` owns (all)."""
    state = AdmissionState(config)
    where, args = "", []
    if shard is not None and not shard.serves_all:
        where = " AND (queue = ANY($1::text[]) OR ($2 AND NOT queue = ANY($3::text[])))"
        args = [shard.queues(config), shard.owns_unknown_queues, [q.name for q in config.queues]]
    rows = await conn.fetch(
        "SELECT spec, status, submitted_at, admitted_at, flavors, usage, borrowing, predicted_gpu_s "
        "FROM admission.jobs "
        f"WHERE status IN ('pending', 'admitted') AND approval IS DISTINCT FROM 'required' "
        f"AND retry_not_before IS NULL{where} "
        "ORDER BY submitted_at, job_id", *args)
    for r in rows:
        spec = JobSpec.model_validate_json(r["spec"])
        if r["status"] == "admitted":
            state.restore_admitted(AdmittedWorkload(
                spec=spec, submitted_at=r["submitted_at"], admitted_at=r["admitted_at"],
                flavors=json.loads(r["flavors"] or "{}"), usage=json.loads(r["usage"] or "{}"),
                borrowing=bool(r["borrowing"])))
        else:
            # the prediction stored at receipt keeps the job's place; ignored while duration ordering is off
            predicted = r["predicted_gpu_s"] if config.policy.duration_ordering else None
            state.requeue(Workload(spec, r["submitted_at"], predicted_gpu_s=predicted))
    return state


async def load_backoff(conn: asyncpg.Connection, config: QueuesConfig,
                       shard: Shard | None = None) -> dict[str, float]:
    """Jobs of the queues `shard` owns (all) that wait out a retry backoff, and until when."""
    where, args = "", []
    if shard is not None and not shard.serves_all:
        where = " AND (queue = ANY($1::text[]) OR ($2 AND NOT queue = ANY($3::text[])))"
        args = [shard.queues(config), shard.owns_unknown_queues, [q.name for q in config.queues]]
    rows = await conn.fetch("SELECT job_id, retry_not_before FROM admission.jobs WHERE status = 'pending' "
                            f"AND retry_not_before IS NOT NULL{where} ORDER BY job_id", *args)
    return {r["job_id"]: float(r["retry_not_before"]) for r in rows}


async def load_expected_ends(conn: asyncpg.Connection) -> dict[str, float]:
    """When this instance's placed jobs are expected to end (their rows: placement or start + max_runtime_s)."""
    return {r["job_id"]: float(r["expected_end"]) for r in await conn.fetch(
        "SELECT job_id, coalesce(expected_end, admitted_at + (spec->>'max_runtime_s')::double precision) "
        "AS expected_end FROM admission.jobs WHERE status = 'admitted' AND bindings IS NOT NULL ORDER BY job_id")}
