"""The telemetry service: folds events into the pure core, persists what the gauges need, serves
`/metrics`, queues webhook deliveries for subscribed events and runs the delivery worker.

    svc = TelemetryService(metrics_port=9464, queues=load_queues("queues.yaml"))
    runtime = ServiceRuntime(svc.spec(), nats_url=..., pool=...)

The HTTP endpoint runs in a thread (prometheus_client); a lock keeps a scrape from reading the core
while a handler changes it. The core's state is written in the handler's transaction, so a restart
rebuilds the same gauges (`on_start`). If a transaction rolls back after the core was changed, the
redelivered event re-applies state idempotently; only its counter increments may count twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from services.core.telemetry.names import JOB_SERIES_CAP
from services.core.telemetry.state import Effects, Gauges, TelemetryState
from services.scheduler import readmodel
from services.telemetry.budgets import BudgetWatch
from services.telemetry.idle import IdleReclaimer
from services.telemetry.metrics import DEFAULT_PORT, TelemetryMetrics, job_labels_from_env
from services.telemetry.webhooks import store
from services.telemetry.webhooks.backoff import RetryPolicy
from services.telemetry.webhooks.delivery import DeliveryWorker
from services.telemetry.webhooks.ssrf import AllowList
from shared.clock import Clock, SystemClock
from shared.config import QueuesConfig, parse_queues
from shared.events import (
    CATALOGUE,
    CloudEvent,
    JobFlopsReported,
    JobIdleWarned,
    NodeChanged,
    NodeInventory,
    Payload,
    QueueConfigChanged,
    UtilizationSampled,
    UtilizationSourceChecked,
)
from shared.service import READER_LINGER_S, ServiceRuntime, ServiceSpec, Tx

if TYPE_CHECKING:
    from services.stack import StackSettings

MIGRATIONS = Path(__file__).parent / "migrations"
# Every job lifecycle event (also the webhook-able ones), plus utilisation (samples, the sources' polls, jobs'
# FLOP/s reports), inventory and queue config.
# (Not its own idle warning: telemetry queued its webhook when it decided it.)
HANDLED: tuple[type[Payload], ...] = (*(c for c in CATALOGUE if c.aggregate == "job" and c is not JobIdleWarned),
                                      UtilizationSampled,
                                      UtilizationSourceChecked, JobFlopsReported, NodeInventory, NodeChanged,
                                      QueueConfigChanged)
_QUEUES_KEY = "queues"
_SOURCE_KEY = "source:"  # + source name: the latest poll of a utilisation source


_PENDING = "telemetry"  # Tx.scratch key and after_events key of what a unit of work has yet to write


@dataclass
class _Pending:
    """What a unit of work's events changed, written at its end (TelemetryService._write_pending)."""

    fx: Effects = field(default_factory=Effects)
    queues: dict[str, Any] | None = None  # the last queue config applied
    webhooks: list[tuple[CloudEvent, str | None, float]] = field(default_factory=list)  # (event, team, now)

    def add(self, fx: Effects) -> None:
        self.fx.observations += fx.observations
        self.fx.jobs |= fx.jobs
        self.fx.samples |= fx.samples
        self.fx.sources |= fx.sources


class TelemetryService:
    def __init__(self, *, metrics_port: int | None = DEFAULT_PORT, metrics_addr: str = "0.0.0.0",
                 queues: QueuesConfig | None = None, clock: Clock | None = None,
                 allow: AllowList | None = None, retry: RetryPolicy | None = None,
                 webhook_worker: bool = True, job_labels: bool | None = None):
        # Per-job gauges name job ids, which /metrics shows to whoever reaches it: only when asked for (None:
        # GPUQ_METRICS_JOB_LABELS). Without them the capped per-job series are simply not exported.
        wanted = job_labels if job_labels is not None else job_labels_from_env()
        self.state = TelemetryState(JOB_SERIES_CAP if wanted else 0)
        if queues is not None:
            self.state.set_queues(queues)
        self.clock: Clock = clock or SystemClock()
        self.lock = threading.Lock()
        self.metrics = TelemetryMetrics(self.snapshot)
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.bound_port: int | None = None
        self.allow = allow if allow is not None else AllowList.from_env()
        self.retry = retry or RetryPolicy.from_env()
        self.webhook_worker = webhook_worker
        self.idle = IdleReclaimer(queues)  # idle reclaim and TTLs of interactive work (services/telemetry/idle.py)
        self.budgets = BudgetWatch()  # GPU-hour budgets' gauges and webhooks (services/telemetry/budgets.py)

    # ------------------------------------------------------------------ wiring

    def spec(self) -> ServiceSpec:
        background = [self._serve_metrics, self._idle_reclaim, self.budgets.run]
        if self.webhook_worker:
            background.append(self._deliver_webhooks)
        return ServiceSpec(name="telemetry", schema="telemetry", migrations=MIGRATIONS,
                           handlers={cls: self.on_event for cls in HANDLED}, on_start=self.on_start,
                           background=background,
                           # Applying an event again leaves the core as it was, and counters are recorded with
                           # the batch-end writes: a batch may be handled again after one of its messages failed.
                           optimistic_batches=True, batch_linger_s=READER_LINGER_S)

    def snapshot(self) -> Gauges:
        with self.lock:
            return {**self.state.gauges(self.clock.now()), **self.budgets.gauges}

    # ------------------------------------------------------------------ events

    def apply(self, payload: Payload, now: float, subject: str = "", *,
              record: bool = True) -> tuple[Effects, str | None]:
        """Fold one event into the core (no I/O) and record its counters (unless `record` is false: the caller
        records `fx.observations` itself); returns the effects and the team the event concerns (looked up before
        a finishing job's record is dropped). `subject` is the one the event arrived on (its scope token names the
        publishing team of a team-scoped event, and a submission is believed for that team only; an in-process call
        names none, and vouches for the payload as the runtime's own calls do)."""
        scope = (type(payload).scope_of(subject) or "") if payload.scope and subject else None
        with self.lock:
            team = self.state.team_of(payload, scope)
            fx = self.state.apply(payload, now, scope)
            if isinstance(payload, UtilizationSampled):
                self.idle.sample(payload, self.state)
        if record:
            self.metrics.record(fx.observations)
        return fx, team

    async def on_event(self, tx: Tx, event: CloudEvent, payload: Payload) -> None:
        fx, team = self.apply(payload, tx.now, tx.subject, record=False)
        if payload.aggregate == "job":
            await self.idle.on_job_event(tx, payload)
        # What the event changed is written once for the unit of work (a consumed batch: once for all its
        # messages, each record with its state after the last of them), at its end, in its transaction. Added to
        # last: nothing after this can fail and leave a rolled-back message's part behind.
        pending: _Pending = tx.scratch.setdefault(_PENDING, _Pending())
        pending.add(fx)
        if fx.quotas and isinstance(payload, QueueConfigChanged):
            pending.queues = payload.config
        if payload.aggregate == "job":
            pending.webhooks.append((event, team, tx.now))
        await tx.after_events(_PENDING, self._write_pending)

    async def _write_pending(self, tx: Tx) -> None:
        pending: _Pending | None = tx.scratch.pop(_PENDING, None)
        if pending is None:
            return
        # The unit of work's counter increments (summed per series by the metrics layer) and histogram observations.
        self.metrics.record(pending.fx.observations)
        await self.persist(tx.conn, pending.fx)
        if pending.queues is not None:
            await self.persist_queues(tx.conn, pending.queues)
        if pending.webhooks:
            await store.enqueue_many(tx.conn, pending.webhooks)
        with self.lock:
            clocks = self.idle.changes()  # the idle clocks the samples moved (and any the check loop has not written)
        try:
            await self.idle.persist(tx.conn, clocks)
        except BaseException:
            with self.lock:
                if self.idle.watch is not None:
                    self.idle.watch.unwritten([job_id for job_id, _ in clocks])
            raise

    async def persist(self, conn: asyncpg.Connection, fx: Effects) -> None:
        """Write the records `fx` names as the core holds them now: one statement per table and kind, whatever
        the number of records (a record the core no longer holds is deleted)."""
        with self.lock:
            jobs = [(j, self.state.job_json(j)) for j in sorted(fx.jobs)]
            samples = [(n, self.state.sample_json(n)) for n in sorted(fx.samples)]
            sources = [(n, self.state.source_json(n)) for n in sorted(fx.sources)]
        kept = [(_SOURCE_KEY + name, doc) for name, doc in sources if doc is not None]
        if kept:
            await conn.execute("INSERT INTO telemetry.settings(key, doc) SELECT k, d::jsonb FROM "
                               "unnest($1::text[], $2::text[]) AS t(k, d) ON CONFLICT (key) DO UPDATE SET doc = "
                               "excluded.doc", [k for k, _ in kept], [doc for _, doc in kept])
        # (Nodes are not persisted here: they are the scheduler's fact, reloaded from its read model at start.)
        for table, key, rows in (("jobs", "job_id", jobs), ("samples", "node", samples)):
            gone = [k for k, doc in rows if doc is None]
            if gone:
                await conn.execute(f"DELETE FROM telemetry.{table} WHERE {key} = ANY($1::text[])", gone)
            upserts = [(k, doc) for k, doc in rows if doc is not None]
            if upserts:
                await conn.execute(
                    f"INSERT INTO telemetry.{table}({key}, doc) SELECT k, d::jsonb FROM "
                    f"unnest($1::text[], $2::text[]) AS t(k, d) ON CONFLICT ({key}) DO UPDATE SET doc = excluded.doc",
                    [k for k, _ in upserts], [d for _, d in upserts])

    async def persist_queues(self, conn: asyncpg.Connection, config: dict[str, Any]) -> None:
        await conn.execute("INSERT INTO telemetry.settings(key, doc) VALUES ($1, $2::jsonb) "
                           "ON CONFLICT (key) DO UPDATE SET doc = excluded.doc", _QUEUES_KEY, json.dumps(config))

    # ------------------------------------------------------------------ lifecycle

    async def load(self, conn: asyncpg.Connection) -> None:
        """Rebuild the core from its tables and the scheduler's read model (after a restart)."""
        state = TelemetryState(self.state.job_series_cap)
        state.guaranteed, state.prices, state.flavors = self.state.guaranteed, self.state.prices, self.state.flavors
        for row in await conn.fetch("SELECT doc FROM telemetry.jobs ORDER BY job_id"):
            state.load_job(json.loads(row["doc"]))
        # The nodes, their health and why it changed, as their owner (the scheduler) knows them now; events keep
        # them current from then on.
        for fact in await readmodel.node_facts(conn):
            state.load_node({"node": fact.spec.model_dump(mode="json"), "reason": fact.reason,
                             "message": fact.message})
        for row in await conn.fetch("SELECT doc FROM telemetry.samples ORDER BY node"):
            state.load_sample(json.loads(row["doc"]))
        for row in await conn.fetch("SELECT doc FROM telemetry.settings WHERE key LIKE $1 ORDER BY key",
                                    _SOURCE_KEY + "%"):
            state.load_source(json.loads(row["doc"]))
        doc = await conn.fetchval("SELECT doc FROM telemetry.settings WHERE key = $1", _QUEUES_KEY)
        if doc is not None:
            state.set_queues(parse_queues(json.loads(doc), "<telemetry.settings queues>"))
        with self.lock:
            self.state = state

    async def on_start(self, runtime: ServiceRuntime) -> None:
        self.clock = runtime.clock
        async with runtime.pool.acquire() as conn:
            await self.load(conn)
            await self.idle.load(conn)

    async def _serve_metrics(self, runtime: ServiceRuntime) -> None:
        if self.metrics_port is None:
            return
        self.bound_port = self.metrics.serve(self.metrics_port, self.metrics_addr)
        try:
            await asyncio.Event().wait()
        finally:
            with contextlib.suppress(Exception):
                self.metrics.shutdown()

    async def _idle_reclaim(self, runtime: ServiceRuntime) -> None:
        await self.idle.run(runtime, lambda: (self.state, self.lock))

    async def _deliver_webhooks(self, runtime: ServiceRuntime) -> None:
        worker = DeliveryWorker(runtime.pool, runtime.clock, allow=self.allow, policy=self.retry)
        await worker.run_forever()


def service_spec(**kwargs: Any) -> ServiceSpec:
    """The ServiceSpec with default settings (metrics on :9464, allow-list from GPUQ_WEBHOOK_ALLOW_CIDRS)."""
    return TelemetryService(**kwargs).spec()


def build_spec(settings: StackSettings) -> ServiceSpec:
    """What `services.stack` calls: telemetry with the stack's queues, clock and metrics port."""
    return TelemetryService(metrics_port=settings.metrics_port, metrics_addr=settings.bind, queues=settings.queues,
                            clock=settings.clock, job_labels=settings.metrics_job_labels).spec()
