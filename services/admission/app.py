"""The admission service: a thin adapter between the bus, Postgres and the pure admission core.

Every handled event runs one admission cycle in the same transaction, so the jobs table, the quota
reservations and the emitted events (JobAdmitted, JobPending, JobRejected, PreemptionRequested) commit
together. The in-memory `AdmissionState` is rebuilt from the jobs table at start, and again whenever a
transaction fails after the state was touched, so memory never runs ahead of Postgres.

Sharding (docs/admission.md, "Running several admission instances"): an instance serves all cohorts (the
default) or a set of them. A per-cohort instance leads per cohort, receives every event on its own durable
consumers, and handles only those of its cohorts' queues (`claim`); it keeps only their jobs in memory.
Every instance applies configuration changes; ownership always follows the configuration in force, which
changes only between units of work (a Postgres advisory lock), so no two instances act for the same queue.

ETAs: the cluster (nodes, and where every job holds GPUs until when) is the scheduler's fact. Admission keeps no
copy of it: each ETA refresh reads the scheduler's read model (services/scheduler/readmodel.py) at that moment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol

import asyncpg
from pydantic import ValidationError

from services.admission import configmodel, prefetch, queuemodel
from services.admission.changecheck import check_proposal
from services.admission.core import (
    AdmissionState,
    AdmittedWorkload,
    QueueFacts,
    Reason,
    Workload,
    approval,
    governance,
    identity,
    queue_facts,
)
from services.admission.core.configcheck import QueueJobs
from services.admission.core.limits import Bucket, pending_refusal, rate_refusal
from services.admission.core.statuses import PendingStatuses, message_text
from services.admission.held import AFTER_EVENTS_KEY as HELD_KEY
from services.admission.held import held_rows, hold_rows, write_held
from services.admission.publish import MESSAGE_EVERY_S, Published, worth_publishing
from services.admission.sharding import Shard
from services.pipeline.core import admit
from services.pipeline.core.predict import DurationPredictor, JobKey
from services.preemption.core import priority_of
from services.scheduler import readmodel
from services.scheduler.core import ClusterState
from shared import audit, forked
from shared.audit import service_actor, team_actor
from shared.config import ConfigError, QueuesConfig, StopPolicy, TeamPolicy, parse_queues, queues_document, queues_hash
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
    JobPending,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    Payload,
    PreemptionReason,
    PreemptionRequested,
    QueueConfigChanged,
    QueueUsageReported,
    utcnow_from,
)
from shared.health import CONFIG_STATE_KEY, ConfigInForce
from shared.leader import lock_key
from shared.service import Handler, ServiceRuntime, ServiceSpec, Tx

log = logging.getLogger("gpuq.admission")
MIGRATIONS = Path(__file__).parent / "migrations"

class EtaRange(Protocol):
    """An expected start and its p10-p90 range (epoch seconds)."""

    @property
    def start(self) -> float: ...
    @property
    def low(self) -> float: ...
    @property
    def high(self) -> float: ...


class EtaFn(Protocol):
    """Expected starts {job_id: range} from (cluster, admission state, reserved ends of jobs holding GPUs, now):
    the forward simulation with the production cores and predicted durations (services/eta, PlatformEta),
    injected so the service stays thin. It learns from the starts and ends admission tells it."""

    def __call__(self, cluster: ClusterState, state: AdmissionState, reserved_ends: Mapping[str, float],
                 now: float) -> Mapping[str, EtaRange]: ...
    def job_started(self, job_id: str, started_at: float) -> None: ...
    def job_preempted(self, job_id: str, at: float) -> None: ...
    def job_finished(self, spec: JobSpec, ran_s: float | None, ended_at: float | None = None) -> None: ...
    def predicted_s(self, spec: JobSpec) -> float: ...
    def refresh_due(self, last_refresh: float | None, now: float, changed: bool) -> bool: ...
    # __call__ in steps, for a replay in a forked child (replay_forked there; learn and remember in the service's
    # process with what it returned):
    def replay_forked(self, cluster: ClusterState, state: AdmissionState, reserved_ends: Mapping[str, float],
                      now: float) -> tuple[Mapping[str, EtaRange], Any, Mapping[str, tuple[str, float]]]: ...
    def learn(self, arrivals: Any, now: float) -> None: ...  # arrivals: what replay_forked returned
    def remember(self, etas: Mapping[str, Any], queued: Mapping[str, tuple[str, float]], now: float
                 ) -> None: ...  # etas: what replay_forked returned (the implementation's own range type)


ETA_INTERVAL_S = 0.5  # wall seconds between looks at whether an ETA refresh is due (refresh_due: platform time)
ETA_DUTY_FACTOR = 5.0  # the pause after an ETA simulation is at least this many times its duration
# Replay ETAs in a forked child (shared/forked.py) rather than a worker thread, which shares the handlers' GIL: with
# 10,000 jobs waiting, the thread made the steady scenario's p99 submit->placed seconds long.
ETA_IN_FORK = True
# Held shared by a per-cohort instance's units of work and exclusively while a configuration is recorded.
CONFIG_LOCK = lock_key("admission-config")
BACKOFF_REASON = "BackoffAfterFailure"  # a failed attempt waits out its retry backoff (JobAttemptFailed)
BACKOFF_TICK_S = 0.2  # wall seconds between looks at whether a backoff ended (the end itself is platform time)
# The predictor's history is rebuilt at start from at most this many of the most recently finished runs: it bounds
# start-up work (the predictor keeps the last 200 runs per group, so this covers the busiest 25 groups in full).
HISTORY_REBUILD_LIMIT = 5000
# Ends after which a job ran as long as it needed (or up to its limit): the only run times that are history.
RAN_TO_THE_END = ("Succeeded", "DeadlineExceeded")
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
        self.state = AdmissionState(config)
        # this instance's placed jobs -> placed_at (then started_at) + max_runtime_s, from their JobPlaced/JobStarted
        self.expected_end: dict[str, float] = {}
        self.eta = eta
        self.eta_interval_s = eta_interval_s
        # Run-time history for duration-aware ordering: the ETA's predictor when there is an ETA (one owner of the
        # history), otherwise one of admission's own.
        self._predictor = DurationPredictor() if eta is None else None
        # Fair share over time: metering's latest QueueUsageReported (its read model; admission keeps no copy of
        # the ledger), re-applied whenever the state is rebuilt. Memory only: after a restart the next report
        # (within one period) brings it back.
        self._usage: QueueUsageReported | None = None
        self._version = 0  # bumped by every handled event; the ETA loop recomputes only when it moved
        # the status last written to the table, and when (reason, message, positions, service clock)
        self._published: dict[str, tuple[str, str, int, int, float]] = {}
        self._announced: dict[str, Published] = {}  # the status last sent as JobPending (publish.py)
        # When the last cycle walked the settled queues' rows too (see `cycle`), service clock
        self._settled_walked_at = float("-inf")
        self._etas: dict[str, tuple[float, float, float]] = {}  # job -> (start, p10, p90) last published
        self._etas_published_at: float | None = None  # the platform time of the last publish_etas
        self._reclaims_sent: set[str] = set()
        # Jobs waiting out a retry backoff (pending, held outside the queue) -> when they may be admitted again.
        self.backoff: dict[str, float] = {}
        self._drains_sent: dict[str, set[str]] = {}  # HoldAndDrain queue -> the running jobs last asked to drain
        # team -> its submission tokens (core/limits.py). In memory: a restarted admission starts every team full.
        self._buckets: dict[str, Bucket] = {}
        # The queues' read model rows this instance last wrote (queuemodel.py), and under which configuration: a
        # cycle writes only the rows that changed. Cleared with memory when the runtime rebuilds it.
        self._queue_rows: dict[str, QueueFacts] = {}
        self._queue_rows_config: QueuesConfig | None = None

    def spec(self) -> ServiceSpec:
        sharded = not self.shard.serves_all
        return ServiceSpec(
            name="admission", schema="admission", migrations=MIGRATIONS, singleton=True,
            handlers={JobSubmitted: self.on_submitted,
                      # these hold their row updates for the batch's end too, and read no row
                      JobCompleted: self.on_finished, JobFailed: self.on_finished,
                      JobPlaced: self.on_placed, JobStarted: self.on_started,
                      **{kind: _writing_held_first(handler) for kind, handler in (
                          (JobCancelRequested, self.on_cancel_requested), (JobApproved, self.on_approved),
                          (JobCancelled, self.on_cancelled), (JobPreempted, self.on_preempted),
                          (JobAttemptFailed, self.on_attempt_failed), (QueueConfigChanged, self.on_config_changed),
                          (QueueUsageReported, self.on_usage_reported))}},
            on_start=self.load, reload=self._rebuild, optimistic_batches=True,
            # (per-cohort instances write the same tables: a batch-start read could miss another's row)
            prefetch=None if sharded else prefetch.prefetch_submissions,
            background=(self.backoff_loop, self.eta_loop) if self.eta is not None else (self.backoff_loop,),
            consumer_suffix=self.shard.consumer_suffix, lease_scopes=self.shard.lease_scopes,
            shared_lease_scopes=self.shard.shared_lease_scopes, claim=self.claim if sharded else None,
            broadcast=BROADCAST if sharded else frozenset(),
        )

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
            await self._rebuild_history(tx.conn)
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
        self._config_version, config = await latest_config(conn, self.initial_config)
        self.state = await load_jobs(conn, config, self.shard)
        self.backoff = await load_backoff(conn, config, self.shard)
        self._apply_usage()
        self.expected_end = await load_expected_ends(conn)
        self._published.clear()
        self._announced.clear()
        self._etas.clear()
        self._queue_rows.clear()  # what was written in a failed unit of work was rolled back with it
        self._queue_rows_config = None
        self._version += 1

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

    async def _rebuild_history(self, conn: asyncpg.Connection) -> None:
        """At start only (a reload keeps the history in memory): the run times of the most recent finished jobs,
        oldest first, as `_finish` recorded them, so predictions survive a restart."""
        rows = await conn.fetch(
            "SELECT spec, ran FROM (SELECT job_id, spec, finished_at, finished_at - started_at AS ran "
            "FROM admission.jobs WHERE status = 'finished' AND started_at IS NOT NULL AND outcome = ANY($1::text[]) "
            "ORDER BY finished_at DESC, job_id DESC LIMIT $2) t ORDER BY finished_at, job_id",
            list(RAN_TO_THE_END), HISTORY_REBUILD_LIMIT)
        for r in rows:
            self._observe(JobSpec.model_validate_json(r["spec"]), max(0.0, r["ran"]))
        if rows:
            log.info("admission: run-time history rebuilt from %d finished jobs", len(rows))

    def _observe(self, spec: JobSpec, ran_s: float | None, ended_at: float | None = None) -> None:
        """A job ended (`ran_s`: its run time, None if it never ran or ended early; at `ended_at` when known, which
        makes it cohort evidence for the running jobs of its group): history for predictions."""
        if self.eta is not None:
            self.eta.job_finished(spec, ran_s, ended_at)
        elif self._predictor is not None and ran_s is not None:
            self._predictor.observe(JobKey.of(spec), float(spec.max_runtime_s), max(0.0, ran_s))

    def predicted_gpu_s(self, spec: JobSpec) -> float | None:
        """Duration-aware ordering (policy.duration_ordering): the job's predicted GPU-seconds from its limit and the
        history of similar finished jobs (never its true duration); None when the policy is off."""
        if not self.state.config.policy.duration_ordering:
            return None
        if self.eta is not None:
            seconds = self.eta.predicted_s(spec)
        else:
            assert self._predictor is not None
            seconds = self._predictor.predict(JobKey.of(spec), float(spec.max_runtime_s)).median_s
        return seconds * spec.total_gpus

    def _stored(self, row: Mapping[str, object]) -> float | None:
        """A job's stored prediction (admission.jobs.predicted_gpu_s) when duration ordering is on."""
        value = row["predicted_gpu_s"]
        return float(value) if isinstance(value, int | float) and self.state.config.policy.duration_ordering else None

    async def _reload_owned(self, conn: asyncpg.Connection) -> None:
        """The configuration in force changed (here or in another instance): take this instance's queues under it
        from the tables. Memory and tables agree at this point, so what was published stays valid for the jobs
        kept; jobs that moved here get their status published by the next cycle."""
        self._config_version, config = await latest_config(conn, self.initial_config)
        self.state = await load_jobs(conn, config, self.shard)
        self.backoff = await load_backoff(conn, config, self.shard)
        self._apply_usage()
        held = self.state.pending.keys() | self.state.admitted.keys()
        for cache in (self._published, self._announced, self._etas):
            for job_id in [j for j in cache if j not in held]:
                del cache[job_id]
        self._version += 1

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

    async def _then_cycle(self, tx: Tx, body: Callable[[], Awaitable[None]]) -> None:
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
        self._version += 1

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

    # ------------------------------------------------------------------ handlers

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        """A submission, authorised by its subject: the team is the subject's (the runtime checked the subject fits
        the type), never the payload's. Queue order starts at the time admission received it (`tx.now`): a producer
        cannot backdate a job past others by writing an old `submitted_at`."""
        spec = payload.spec
        team = JobSubmitted.scope_of(tx.subject) or ""
        actor = team_actor(team)
        received_at = tx.now

        async def audited(kind: str, reason: str | None = None, message: str | None = None) -> None:
            await audit.record(tx, "submit" if kind != "rejected" else "submit_refused", actor, job_id=spec.job_id,
                               team=team, queue=spec.queue, verdict=kind, reason=reason, message=message,
                               claimed_by=payload.submitted_by or spec.user, event_id=event.id, gpus=spec.total_gpus,
                               priority_class=spec.priority_class)

        async def verdict(kind: str, reason: str | None = None, message: str | None = None) -> None:
            await tx.conn.execute(
                "INSERT INTO admission.submissions(event_id, job_id, team, verdict, reason, message, at) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id) DO NOTHING",
                event.id, spec.job_id, team, kind, reason, message, tx.now)
            await audited(kind, reason, message)

        async def reject(reason: str, message: str, record_job: bool) -> None:
            if record_job:
                await tx.conn.execute(
                    "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, reason, message) "
                    "VALUES ($1, $2, $3, $4, 'rejected', $5, $6, $7)",
                    spec.job_id, spec.team, spec.queue, spec.model_dump_json(), received_at, reason, message)
            await tx.conn.execute(
                "INSERT INTO admission.audit(at, actor, action, job_id, detail) VALUES ($1, $2, 'reject', $3, $4)",
                tx.now, actor, spec.job_id,
                json.dumps({"reason": reason, "message": message, "team": team, "queue": spec.queue,
                            "event_id": event.id, "source": event.source}))
            await tx.emit(JobRejected(job_id=spec.job_id, team=team, queue=spec.queue, reason=reason, message=message))
            await verdict("rejected", reason, message)

        async def body() -> None:
            # Every submission on a team's subject costs it a token, whatever becomes of it: a flood is refused
            # before anything is looked up, and the id stays free (no job row) for when the team submits it again.
            limited = rate_refusal(self._buckets, team, spec.job_id, received_at,
                                   self.state.config.governance.for_team(team))
            if limited is not None:
                await reject(limited.reason, limited.message, False)
                return
            # Whether the job id is taken (by which team) and whether a cancel for it came first, in one round trip (a
            # tombstone is rare: it is taken below only when there is one).
            # (in a consumed batch, read for all its submissions at once: services/admission/prefetch.py)
            known = prefetch.take(tx.scratch, spec.job_id, team)
            existing, holder, tombstoned = known if known is not None else await prefetch.lookup(
                tx.conn, spec.job_id, team)
            earlier = held_rows(tx)
            if existing is None and earlier is not None and spec.job_id in earlier.jobs:
                # queued earlier in this batch, its row not written yet
                existing, holder = "pending", earlier.jobs[spec.job_id][0]
            elif existing is not None and earlier is not None and earlier.updates(spec.job_id):
                # its row changed earlier in this batch (an end, say), not written yet: the refusal says its status
                await write_held(tx)
                existing = await tx.conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", spec.job_id)
            # An id another team holds, or one reserved for another team (`<team>::<name>`): refused without a row,
            # and in words that say nothing of that team's job (core/identity.py).
            taken = identity.unavailable(spec.job_id, team, holder)
            if taken is not None:
                await reject(*taken, False)
                return
            if existing is not None:  # the submitting team's own job: it may hear its status
                await reject(identity.DUPLICATE_JOB_ID, f"job id {spec.job_id} was already submitted ({existing})",
                             False)
                return
            if spec.team != team:
                # No row either: a row in the named team's view would be a ghost there, and would take the id from it.
                await reject("Unauthorized", f"job {spec.job_id} names team {spec.team!r} but was submitted with "
                                             f"team {team!r}'s credential (subject {tx.subject})", False)
                return
            policy = self.state.config.governance.for_team(team)
            violation = governance.submission_violation(spec, policy, self.state.config.team_namespaces(team))
            if violation is not None:
                await reject(violation.reason, violation.message, True)
                return
            crowded = pending_refusal(team, spec.job_id, await self._waiting(tx, spec, team, policy), policy)
            if crowded is not None:
                await reject(crowded.reason, crowded.message, False)  # no row: the id stays free for later
                return
            predicted = self.predicted_gpu_s(spec)
            rejection = self.state.submit(Workload(spec, received_at, predicted_gpu_s=predicted))
            if rejection is not None:
                await reject(rejection.reason, rejection.message, True)
                return
            tombstone = await tx.conn.fetchrow(
                "DELETE FROM admission.tombstones WHERE job_id = $1 AND team = $2 RETURNING requested_at, event_id",
                spec.job_id, team) if tombstoned else None
            if tombstone is not None:
                # Cancelled before it arrived: it never waits, and everyone hears it is cancelled.
                self.state.finish(spec.job_id)
                await tx.conn.execute(
                    "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, finished_at, outcome)"
                    " VALUES ($1, $2, $3, $4, 'finished', $5, $5, 'Cancelled')",
                    spec.job_id, team, spec.queue, spec.model_dump_json(), received_at)
                await tx.emit(JobCancelled(job_id=spec.job_id, by=actor, reason="cancelled before it was received",
                                           cancelled_at=utcnow_from(tx.now)))
                await verdict("cancelled", "Cancelled", "a cancel for this job arrived before the job")
                return
            awaits = approval.approval_reason(spec, policy, self.state.config)
            if awaits is not None:
                self.state.finish(spec.job_id)  # held outside the queue until an admin approves it
                message = f"{awaits}: gpuq approve {spec.job_id}"
                await tx.conn.execute(
                    "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, approval, reason, "
                    "message, predicted_gpu_s) VALUES ($1, $2, $3, $4, 'pending', $5, 'required', $6, $7, $8)",
                    spec.job_id, team, spec.queue, spec.model_dump_json(), received_at,
                    governance.AWAITING_APPROVAL, message, predicted)
                await tx.emit(JobQueued(job_id=spec.job_id, queue=spec.queue, team=team))
                await tx.emit(JobPending(job_id=spec.job_id, queue=spec.queue, reason=governance.AWAITING_APPROVAL,
                                         message=message))
                await verdict("awaiting_approval", governance.AWAITING_APPROVAL, message)
                return
            await tx.emit(JobQueued(job_id=spec.job_id, queue=spec.queue, team=team))
            row = (team, spec.queue, spec.model_dump_json(), received_at, predicted)
            if not self._may_hold(tx):
                # written at once: in a savepoint of its own (see Tx.own_savepoint), or where `claim` reads the
                # table before a later message's handler runs
                await tx.conn.execute(
                    "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, predicted_gpu_s) "
                    "VALUES ($1, $2, $3, $4, 'pending', $5, $6)", spec.job_id, *row)
                await verdict("queued")
                return
            # Held for the batch's end (services/admission/held.py): two statements for the batch's submissions.
            await audited("queued")  # its submissions row is held with the job's
            rows = hold_rows(tx)  # last: nothing after it can fail
            rows.jobs[spec.job_id] = row
            rows.verdicts.append((event.id, spec.job_id, team, tx.now))

        await self._then_cycle(tx, body)

    async def _waiting(self, tx: Tx, spec: JobSpec, team: str, policy: TeamPolicy) -> int:
        """The team's jobs waiting in its queues (the core's count), and for a job that would wait for an admin's
        approval also those already waiting for one (held outside the queues, so counted in the table)."""
        waiting = self.state.pending_of(team)
        if policy.max_pending_jobs is not None and approval.approval_reason(spec, policy, self.state.config):
            waiting += await tx.conn.fetchval(
                "SELECT count(*) FROM admission.jobs WHERE team = $1 AND status = 'pending' AND approval = 'required'",
                team)
        return waiting

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
            await self._finish(tx, job_id, "Cancelled")
            await tx.emit(JobCancelled(job_id=job_id, by=actor, reason=payload.reason,
                                       cancelled_at=utcnow_from(tx.now)))
            await audit.record(tx, "cancel", actor, job_id=job_id, team=team, outcome="cancelled", **claimed)

        await self._then_cycle(tx, body)

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
            self.state.requeue(Workload(spec, row["submitted_at"], predicted_gpu_s=self._stored(row)))
            await tx.conn.execute(
                "UPDATE admission.jobs SET approval = 'approved', reason = NULL, message = NULL WHERE job_id = $1",
                payload.job_id)
            await audit.record(tx, "approve", f"admin:{payload.approved_by}", job_id=payload.job_id, team=row["team"],
                               outcome="approved", event_id=event.id)

        await self._then_cycle(tx, body)

    async def on_finished(self, tx: Tx, event: CloudEvent, payload: JobCompleted | JobFailed) -> None:
        async def body() -> None:
            await self._finish(tx, payload.job_id, str(payload.exit_reason), hold=self._may_hold(tx))

        await self._then_cycle(tx, body)

    async def on_cancelled(self, tx: Tx, event: CloudEvent, payload: JobCancelled) -> None:
        """Admission's own decision coming back: already applied when it was emitted, so nothing to do (a forged
        one changes nothing here). Consumed so that per-cohort instances mirror other cohorts' cancels (claim)."""

    async def _finish(self, tx: Tx, job_id: str, outcome: str, *, hold: bool = False) -> None:
        """The job ended (`outcome`): memory at once; its row at once, or with `hold` at the batch's end (held.py:
        the update keeps its condition on the row's status, so it changes what it would have changed now)."""
        held = self.state.admitted.get(job_id) or self.state.pending.get(job_id)
        end = self.expected_end.get(job_id)
        if held is not None:  # history for the predicted durations: how long it ran (None: it never ran)
            ran = None if end is None else tx.now - (end - held.spec.max_runtime_s)
            # a job that succeeded or was stopped at its limit ran as long as it needed (or its limit)
            self._observe(held.spec, ran if outcome in RAN_TO_THE_END else None, ended_at=tx.now)
        self.state.finish(job_id)
        self.backoff.pop(job_id, None)  # cancelled while waiting out a retry backoff
        self.expected_end.pop(job_id, None)
        self._etas.pop(job_id, None)
        if hold:
            hold_rows(tx).finished[job_id] = (tx.now, outcome)  # last: nothing after it can fail
            await tx.after_events(HELD_KEY, write_held)
            return
        await tx.conn.execute(
            "UPDATE admission.jobs SET status = 'finished', finished_at = $2, outcome = $3, reason = NULL, "
            "message = NULL, retry_not_before = NULL WHERE job_id = $1 AND status IN ('pending', 'admitted')",
            job_id, tx.now, outcome)

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
            self.state.requeue(Workload(spec, row["submitted_at"], predicted_gpu_s=self._stored(row)))
            self.expected_end.pop(payload.job_id, None)
            self._reclaims_sent.discard(payload.job_id)
            if self.eta is not None:  # its replays give it the preemptor's cool-down from now
                self.eta.job_preempted(payload.job_id, tx.now)
            await tx.conn.execute(
                "UPDATE admission.jobs SET status = 'pending', admitted_at = NULL, flavors = NULL, usage = NULL, "
                "borrowing = NULL, bindings = NULL, started_at = NULL, expected_end = NULL, resume_from = $2 "
                "WHERE job_id = $1", payload.job_id, payload.checkpoint_uri)
            await tx.emit(JobRequeued(job_id=payload.job_id, spec=spec, resume_from=payload.checkpoint_uri,
                                      submitted_at=utcnow_from(row["submitted_at"])))

        await self._then_cycle(tx, body)

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
            self.state.finish(payload.job_id)  # releases the attempt's quota
            self.expected_end.pop(payload.job_id, None)
            self._reclaims_sent.discard(payload.job_id)
            for cache in (self._published, self._announced, self._etas):
                cache.pop(payload.job_id, None)
            self.backoff[payload.job_id] = not_before
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

        await self._then_cycle(tx, body)

    async def backoff_loop(self, runtime: ServiceRuntime) -> None:
        """Wake jobs whose retry backoff ended (platform clock: virtual time in an accelerated run)."""
        while True:
            await asyncio.sleep(BACKOFF_TICK_S)
            if self.backoff and min(self.backoff.values()) <= runtime.clock.now():
                async with runtime.transaction() as tx:
                    await self.end_backoffs(tx)

    async def end_backoffs(self, tx: Tx) -> None:
        """Put every job whose backoff ended back in its queue (original submit time), then run a cycle."""
        if not self.shard.serves_all:
            await self._enter_config_epoch(tx.conn)
        due = sorted(j for j, at in self.backoff.items() if at <= tx.now)
        if not due:
            return
        rows = await tx.conn.fetch(
            "UPDATE admission.jobs SET retry_not_before = NULL, reason = NULL, message = NULL "
            "WHERE job_id = ANY($1::text[]) AND status = 'pending' AND retry_not_before IS NOT NULL "
            "RETURNING job_id, spec, submitted_at, predicted_gpu_s", due)
        for job_id in due:
            self.backoff.pop(job_id, None)
        for r in sorted(rows, key=lambda r: r["job_id"]):
            self.state.requeue(Workload(JobSpec.model_validate_json(r["spec"]), r["submitted_at"],
                                        predicted_gpu_s=self._stored(r)))
        await self._cycle_and_count(tx)

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
                self.state = await load_jobs(tx.conn, config, self.shard)
            self._apply_usage()  # the new configuration's quotas and half-life
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
        so a cycle runs. An older report than the one in force (a redelivery, a second metering replica) changes
        nothing."""
        if self._usage is not None and payload.at <= self._usage.at:
            return
        self._usage = payload

        async def body() -> None:
            self._apply_usage()

        await self._then_cycle(tx, body)

    def _apply_usage(self) -> None:
        """Hand the latest report to the core when the policy asks for history with the report's half-life (a
        report made under another half-life, before metering saw a configuration change, is not used)."""
        half_life = self.state.config.policy.usage_half_life_s
        usage = self._usage
        if half_life is not None and usage is not None and usage.half_life_s == half_life:
            self.state.set_usage_history(usage.usage, float(half_life))
            return
        if half_life is not None and usage is not None:
            log.warning("admission: ignoring a usage report decayed with a %ss half-life (policy: %ss)",
                        usage.half_life_s, half_life)
        # off, or no usable report: only current usage counts (an empty history clears the historic standing)
        self.state.set_usage_history({}, float(half_life or 1))

    # ------------------------------------------------------------------ placements of this instance's jobs

    async def on_placed(self, tx: Tx, event: CloudEvent, payload: JobPlaced) -> None:
        """Where an admitted job runs (when it was placed: its expected end). The row's update is held for the
        batch's end where it may be (held.py); memory says whether the job is admitted, as its row's status does
        (this instance's jobs: `claim` hands a per-cohort instance only those)."""
        bindings = json.dumps([b.model_dump(mode="json") for b in payload.bindings])
        if self._may_hold(tx):
            updated = payload.job_id in self.state.admitted
        else:
            updated = await tx.conn.fetchval(
                "UPDATE admission.jobs SET bindings = $2 WHERE job_id = $1 AND status = 'admitted' RETURNING true",
                payload.job_id, bindings)
        if updated:
            self.expected_end[payload.job_id] = payload.placed_at.timestamp() + payload.spec.max_runtime_s
            self._etas.pop(payload.job_id, None)
            self._version += 1
            queue = self.state.config.queue_map.get(payload.spec.queue)
            if queue is not None and queue.stop_policy is StopPolicy.HOLD_AND_DRAIN:
                # admitted before the queue was drained, placed since: it is drained too
                await tx.after_events("admission-drain", self._drain_held_queues)
            if self._may_hold(tx):
                hold_rows(tx).placed[payload.job_id] = bindings  # last: nothing after it can fail
                await tx.after_events(HELD_KEY, write_held)

    async def on_started(self, tx: Tx, event: CloudEvent, payload: JobStarted) -> None:
        """An admitted job started: it is expected to end by its start + max_runtime_s (held as on_placed)."""
        started_at = payload.started_at.timestamp()
        expected_end: float | None = None
        if self._may_hold(tx):
            held = self.state.admitted.get(payload.job_id)
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
            self.expected_end[payload.job_id] = expected_end
            if self.eta is not None:  # calibration: the ETAs this job was given against its start
                self.eta.job_started(payload.job_id, started_at)
            self._version += 1
            if self._may_hold(tx):
                hold_rows(tx).started[payload.job_id] = (started_at, expected_end)  # last: nothing after it can fail
                await tx.after_events(HELD_KEY, write_held)

    async def eta_loop(self, runtime: ServiceRuntime) -> None:
        """Refresh every waiting job's expected start by forward simulation, off the event path and off the handler
        lock: the simulation runs in a worker thread on a copy of the state (events keep being handled meanwhile),
        and only the writing of the changed ETAs takes the lock. Paced by the platform clock (runtime.clock:
        virtual time in a replay): after a change once ETA_MIN_REFRESH_S passed, otherwise every ETA_REFRESH_S
        (EtaFn.refresh_due: the simulator measures with the same pacing). Bounded: after a simulation that took
        d seconds, the next one waits at least ETA_DUTY_FACTOR x d, so ETAs use at most about 1/ETA_DUTY_FACTOR
        of the time however many jobs wait (they are refreshed less often instead)."""
        seen = -1
        last: float | None = None
        pause = self.eta_interval_s
        while True:
            await asyncio.sleep(pause)
            pause = self.eta_interval_s
            if self.eta is None or not (self.state.pending or self.state.admitted):
                continue
            now = runtime.clock.now()
            # an ETA that was ahead at the last refresh has passed while its job still waits: a change, refreshed as
            # soon as one may be (one given as "now", a job the replay starts at once, does not count: refreshing
            # it every 30 s would only say "now" again)
            overdue = last is not None and any(last < e[0] < now for e in self._etas.values())
            if not self.eta.refresh_due(last, now, self._version != seen or overdue):
                continue
            seen, last = self._version, now
            started = time.perf_counter()
            etas = None
            if self.shard.serves_all:  # (a per-cohort instance first enters the config epoch, in the transaction)
                async with runtime.pool.acquire() as conn:
                    rows = await readmodel.cluster_rows(conn)
                etas = await self._replay_off_process(rows, now)
            async with runtime.transaction() as tx:
                await self.publish_etas(tx, etas)
            pause = max(self.eta_interval_s, ETA_DUTY_FACTOR * (time.perf_counter() - started))

    async def _replay_off_process(self, rows: readmodel.ClusterRows, now: float) -> Mapping[str, EtaRange]:
        """A refresh's replay off the handlers' interpreter lock: in a forked child, which reads the state as it is
        at the fork (copy-on-write: nothing copied, nothing pickled but the ETAs coming back) while the handlers go
        on changing the parent's. Where the platform cannot fork, or ETA_IN_FORK is off, in a worker thread on a
        structural copy (AdmissionState.copy, taken in one go on the event loop: no handler runs meanwhile; a deep
        copy took ~13x its CPU at 10,000 pending), which shares the GIL with the handlers (shared/forked.py)."""
        assert self.eta is not None
        if ETA_IN_FORK and forked.available():
            eta, state = self.eta, self.state

            def replay() -> tuple[Mapping[str, EtaRange], Any, Mapping[str, tuple[str, float]]]:
                # in the child: its own copy of everything, changed or not; it finds the arrivals too (walking
                # every job held), and this process only adds the ones it found
                cluster, ends = cluster_view(rows)
                return eta.replay_forked(cluster, state, ends, now)

            try:
                etas, arrivals, queued = await forked.call(replay)
            except OSError as exc:  # no fork now (out of processes or memory): this refresh in the thread instead
                log.warning("admission: ETA replay could not fork (%s); replaying in a worker thread", exc)
            else:
                eta.learn(arrivals, now)
                eta.remember(etas, queued, now)
                return etas
        # parsed in the worker thread too: a large cluster's specs take a while, and handlers go on meanwhile
        return await asyncio.to_thread(self._estimate_rows, rows, self.state.copy(), now)

    def _estimate_rows(self, rows: readmodel.ClusterRows, state: AdmissionState, now: float
                       ) -> Mapping[str, EtaRange]:
        cluster, ends = cluster_view(rows)
        return self._estimate(cluster, state, ends, now)

    def _estimate(self, cluster: ClusterState, state: AdmissionState, expected_end: Mapping[str, float],
                  now: float) -> Mapping[str, EtaRange]:
        """The one place the ETA function is called."""
        assert self.eta is not None
        return self.eta(cluster, state, expected_end, now)

    async def publish_etas(self, tx: Tx, etas: Mapping[str, EtaRange] | None = None) -> None:
        """Write and announce the ETAs that moved: `etas` as computed off the lock, or computed here (per-cohort
        instances, tests)."""
        if etas is None:
            if not self.shard.serves_all:
                await self._enter_config_epoch(tx.conn)  # publish only for the jobs this instance owns now
            cluster, ends = cluster_view(await readmodel.cluster_rows(tx.conn))
            etas = self._estimate(cluster, self.state, ends, tx.now)
        ranges = etas
        previous, self._etas_published_at = self._etas_published_at, tx.now
        waiting = [j for j in self.state.pending] + [j for j in self.state.admitted if j not in self.expected_end]
        changed: list[tuple[str, float | None, float | None, float | None]] = []
        for job_id in sorted(waiting):
            got = ranges.get(job_id)
            eta = (got.start, got.low, got.high) if got is not None else None
            old = self._etas.get(job_id)
            # Publish when an ETA appears, disappears or moves by more than a minute or 10% of the wait left, and
            # always when the one published was ahead at the last publish and has passed since (the job still
            # waits): readers are not left a time in the past (the API shows such a one as overdue until then).
            if eta is None and old is None:
                continue
            passed = old is not None and old[0] < tx.now and (previous is None or old[0] > previous)
            if (eta is not None and old is not None and not passed
                    and abs(eta[0] - old[0]) <= max(60.0, 0.1 * (eta[0] - tx.now))):
                continue
            if eta is None:
                self._etas.pop(job_id, None)
                changed.append((job_id, None, None, None))
            else:
                self._etas[job_id] = eta
                changed.append((job_id, *eta))
        if not changed:
            return
        await tx.conn.execute(
            "UPDATE admission.jobs AS j SET eta = u.e, eta_low = u.l, eta_high = u.h FROM unnest($1::text[], "
            "$2::float8[], $3::float8[], $4::float8[]) AS u(id, e, l, h) WHERE j.job_id = u.id",
            *(list(c) for c in zip(*changed, strict=True)))
        rows = await tx.conn.fetch(
            "SELECT job_id, queue, status, reason, message, position_in_queue, position_in_cohort FROM admission.jobs "
            "WHERE job_id = ANY($1::text[]) ORDER BY job_id", [c[0] for c in changed])
        for r in rows:
            await tx.emit(JobPending(
                job_id=r["job_id"], queue=r["queue"], stage="admission" if r["status"] == "pending" else "placement",
                reason=r["reason"] or ("WaitingForPlacement" if r["status"] == "admitted" else "Pending"),
                message=r["message"] or "", position_in_queue=r["position_in_queue"],
                position_in_cohort=r["position_in_cohort"], **self._eta_fields(r["job_id"])))
            if r["status"] == "pending" and r["reason"] and r["position_in_queue"] is not None:
                # subscribers now have this status: the cycle's next event for the job is judged against it
                self._announced[r["job_id"]] = Published(r["reason"], r["message"] or "", r["position_in_queue"],
                                                         r["position_in_cohort"], tx.now)

    def _eta_fields(self, job_id: str) -> dict[str, datetime | None]:
        """JobPending's eta, eta_low and eta_high of a job (None when it has no ETA)."""
        eta = self._etas.get(job_id)
        if eta is None:
            return {"eta": None, "eta_low": None, "eta_high": None}
        return {"eta": utcnow_from(eta[0]), "eta_low": utcnow_from(eta[1]), "eta_high": utcnow_from(eta[2])}

    # ------------------------------------------------------------------ the cycle

    async def cycle(self, tx: Tx) -> None:
        decision = admit(self.state, tx.now)  # the pipeline's admission half: quota only
        if decision.admitted:
            # the cycle's admissions in one statement (a burst's batch admits hundreds)
            await tx.conn.execute(
                "UPDATE admission.jobs AS j SET status = 'admitted', admitted_at = u.a, flavors = u.f::jsonb, "
                "usage = u.q::jsonb, borrowing = u.b, reason = NULL, message = NULL, position_in_queue = NULL, "
                "position_in_cohort = NULL FROM unnest($1::text[], $2::float8[], $3::text[], $4::text[], "
                "$5::bool[]) AS u(id, a, f, q, b) WHERE j.job_id = u.id",
                [a.job_id for a in decision.admitted], [a.admitted_at for a in decision.admitted],
                [json.dumps(a.flavors) for a in decision.admitted], [json.dumps(a.usage) for a in decision.admitted],
                [a.borrowing for a in decision.admitted])
        for a in decision.admitted:
            self._published.pop(a.job_id, None)
            self._announced.pop(a.job_id, None)
            await audit.record(tx, "admit", service_actor("admission"), job_id=a.job_id, team=a.spec.team,
                               queue=a.spec.queue, quota=a.usage, borrowing=a.borrowing)
            await tx.emit(JobAdmitted(job_id=a.job_id, spec=a.spec, flavors=a.flavors, quota=a.usage,
                                      borrowing=a.borrowing, submitted_at=utcnow_from(a.submitted_at),
                                      admitted_at=utcnow_from(a.admitted_at)))
        changed = []
        now = tx.now
        # Cohorts the cycle reused unchanged hold the statuses already handled after an earlier cycle. In the
        # others, a message whose only news is its numbers (another queue's admission changes the cohort's
        # lendable count in every waiting job's message) is rewritten at most once a minute, so one admission
        # in a cohort with thousands waiting does not rewrite thousands of rows; reasons and positions always.
        pending = decision.pending
        assert isinstance(pending, PendingStatuses)  # what admission_cycle always returns
        # First the cheap test on every judged row (a cohort with thousands waiting, most unchanged), in the view's
        # order; then, in job id order as before, the few left (sorting only those, not every waiting row).
        published = self._published
        candidates = []
        # Queues whose jobs kept their reasons and positions (sealed at their hard cap; core/cycle.py) are left
        # out of the walk, a deep backlog's thousands of rows, except once per MESSAGE_EVERY_S: only the cohort's
        # numbers in their messages moved, and those are rewritten at most that often anyway.
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
        for job_id, queue, reason, raw_message, qpos, cpos in candidates:
            old = published.get(job_id)
            key = (reason, message_text(raw_message), qpos, cpos)
            if old is not None and old[:4] == key:
                continue
            self._published[job_id] = (*key, now)
            changed.append((job_id, *key))
            if not worth_publishing(self._announced.get(job_id), *key, now):
                continue  # a small move or new numbers: the table has it, the bus hears of it later
            self._announced[job_id] = Published(*key, now)
            await tx.emit(JobPending(job_id=job_id, queue=queue, stage="admission", reason=reason,
                                     message=key[1], position_in_queue=qpos, position_in_cohort=cpos,
                                     **self._eta_fields(job_id)))
        if changed:
            # one statement for all (a cohort's thousands of waiting rows when their reasons move together)
            await tx.conn.execute(
                "UPDATE admission.jobs AS j SET reason = u.r, message = u.m, position_in_queue = u.q, "
                "position_in_cohort = u.c FROM unnest($1::text[], $2::text[], $3::text[], $4::int4[], $5::int4[]) "
                "AS u(id, r, m, q, c) WHERE j.job_id = u.id", *(list(c) for c in zip(*changed, strict=True)))
        for r in decision.reclaims:
            if r.preemptor in self._reclaims_sent:
                continue
            self._reclaims_sent.add(r.preemptor)
            within = r.reason == Reason.PRIORITY_PREEMPTION
            await tx.emit(PreemptionRequested(
                preemptor=r.preemptor, queue=r.queue,
                reason=PreemptionReason.PRIORITY if within else PreemptionReason.RECLAIM,
                need=r.need, own_need=r.own_need, candidates=r.candidates, max_victim_priority=r.max_victim_priority,
                message=(f"queue {r.queue} makes room in its nominal quota for a higher-priority job" if within
                         else f"queue {r.queue} reclaims its nominal quota")))
        await self._drain_held_queues(tx)

    async def _drain_held_queues(self, tx: Tx) -> None:
        """stop_policy HoldAndDrain: ask the preemption service to evict each such queue's running jobs that may be
        preempted (its checkpoint-before-preempt protocol; preemption/core/drain.py), whenever the set of those
        jobs has gained one since the last request. Jobs of classes never preempted (production) are not asked
        for and keep running with their quota; evicted jobs come back pending and wait (WaitingForQueueHeld)."""
        config = self.state.config
        draining = sorted(q.name for q in config.queues if q.stop_policy is StopPolicy.HOLD_AND_DRAIN)
        for name in sorted(set(self._drains_sent) - set(draining)):
            del self._drains_sent[name]
        if not draining:
            return
        running: dict[str, set[str]] = {name: set() for name in draining}
        for job_id, held in self.state.admitted.items():
            jobs = running.get(held.spec.queue)
            if jobs is not None and job_id in self.expected_end and priority_of(config, held.spec)[1]:
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


def cluster_view(rows: readmodel.ClusterRows) -> tuple[ClusterState, dict[str, float]]:
    """The cluster for ETAs, read from its owner at refresh time (the scheduler's read model, `rows`): the nodes,
    every job holding GPUs where it holds them (every cohort's), and when the scheduler expects each to end. Pure:
    the ETA loop runs it in its worker thread."""
    cluster = ClusterState.from_nodes(f.spec for f in readmodel.node_facts_of(rows.nodes))
    expected: dict[str, float] = {}
    for p in readmodel.placements_of(rows.placements):
        try:
            cluster.commit(cluster.make_placement(p.spec, list(p.bindings)))
        except Exception as exc:  # a node removed under a placement: the scheduler reports the job's fate
            log.warning("ETA cluster view: placement of %s not restored: %s", p.job_id, exc)
            continue
        expected[p.job_id] = p.expected_end
    return cluster, expected
