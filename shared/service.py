"""The runtime every service shares: idempotent event handling and the transactional outbox.

Delivery rules (architecture guide, section 2):
- durable pull consumers with explicit ack, bounded redelivery with backoff;
- each event is handled inside one Postgres transaction that also records its id in the service's
  `inbox` table; the JetStream message is acked only after commit, so a crash before commit gets the
  event again and a redelivery after commit changes nothing;
- events a handler emits are written to the service's `outbox` table in that same transaction and
  published afterwards with `Nats-Msg-Id` = event id, so a crash between commit and publish neither
  loses nor duplicates an event;
- poison messages (undecodable, unknown type, invalid payload, or a handler that keeps failing) go to
  `gpuq.dlq.<service>` and the service's `dead_letters` table with the reason, and are acked: never a
  crash, never a silent drop.

FastStream's default ack policy terminates a message on error (no redelivery), so this runtime uses
`AckPolicy.MANUAL` and decides ack / nak-with-delay / dead-letter itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import asyncpg
from faststream.nats import NatsBroker
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus import ConsumerPlan, ensure_streams, stream_for_subject
from shared.clock import Clock, SystemClock
from shared.db import apply_migrations
from shared.events import (
    BY_TYPE,
    SCOPE_TOKEN_RE,
    CloudEvent,
    InvalidEvent,
    JobSubmitted,
    Payload,
    encode_event,
    parse_event,
)
from shared.health import CHECK_TIMEOUT_S, Check, ConsumerState, ServiceHealth, service_health, timed_check
from shared.leader import LeaderLease, LostLeadership, lock_key
from shared.natsauth import inbox_prefix_for
from shared.plumbing.batches import BISECT_PART, SAVEPOINT_BATCHES_AFTER_FAILURE, Batches
from shared.plumbing.consumers import (
    ACK_WAIT_S,
    DEFAULT_STALL_S,
    FETCH_BATCH,
    FETCH_WAIT_S,
    MAX_ACK_PENDING,
    MAX_DELIVER,
    STALL_ENV,
    Consumption,
    stall_after_from_env,
)
from shared.plumbing.deadletters import DEAD_LETTER_MESSAGE_CHARS, DLQ_BODY_BYTES, DeadLetterSink
from shared.plumbing.leadership import LEASE_CHECK_S, LEASE_RECOVERY_BOUND_S, Leadership
from shared.plumbing.outbox import (
    DEFAULT_RETENTION_S,
    EVENT_BYTES_LIMIT,
    HEADER_ROOM,
    MIN_RETENTION_S,
    PRUNE_BATCH,
    PRUNE_EVERY_S,
    PUBLISH_TIMEOUT_S,
    RELAY_BATCH,
    RELAY_POLL_S,
    RETENTION_ENV,
    OutboxRelay,
    retention_from_env,
)
from shared.plumbing.spec import Counters, ServiceSpec
from shared.plumbing.units import (
    _NOT_PREPARED,
    BatchHandler,
    Handler,
    JobTraces,
    Refused,
    Tx,
    _BatchResult,
    _BatchWork,
    _DeadLetter,
    _Optimism,
    _Prepared,
    insert_outbox_rows,
    refused_data,
)
from shared.tracing import current_traceparent, start_span_from_event, with_trace_context

# The runtime's parts live in shared/plumbing/ (one module per responsibility); what services, tools and tests
# import from here stays importable from here.
__all__ = [
    "ACK_WAIT_S", "BISECT_PART", "CHECK_TIMEOUT_S", "DEAD_LETTER_MESSAGE_CHARS", "DEFAULT_RETENTION_S",
    "DEFAULT_STALL_S", "DLQ_BODY_BYTES", "EVENT_BYTES_LIMIT", "FETCH_BATCH", "FETCH_WAIT_S", "HEADER_ROOM",
    "LEASE_CHECK_S", "LEASE_RECOVERY_BOUND_S", "MAX_ACK_PENDING", "MAX_DELIVER", "MIN_RETENTION_S", "NAK_DELAYS_S",
    "PLUMBING_SQL", "PRUNE_BATCH", "PRUNE_EVERY_S", "PUBLISH_TIMEOUT_S", "READER_LINGER_S", "RELAY_BATCH",
    "RELAY_POLL_S", "RETENTION_ENV", "SAVEPOINT_BATCHES_AFTER_FAILURE", "STALL_ENV", "BatchHandler", "Counters",
    "Handler", "JobTraces", "Refused", "ServiceRuntime", "ServiceSpec", "Tx", "_BatchResult", "_BatchWork",
    "_DeadLetter", "_Optimism", "_Prepared", "default_subject", "first_messages_of_jobs", "insert_outbox_rows",
    "publish_event", "refused_data", "retention_from_env", "stall_after_from_env",
]

log = logging.getLogger("gpuq.service")

NAK_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
# `ServiceSpec.batch_linger_s` of the services no decision waits on (telemetry, metering): a status page, a metric
# or a charge that is this much older is no worse, and their batches grow from a few messages to tens at 100 job
# arrivals a second.
READER_LINGER_S = 0.2

PLUMBING_SQL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.inbox (
    event_id text PRIMARY KEY,
    type text NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}.outbox (
    seq bigserial PRIMARY KEY,
    event_id text NOT NULL UNIQUE,
    subject text NOT NULL,
    body bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_unpublished ON {s}.outbox (seq) WHERE published_at IS NULL;
-- The trace each job's events continue (W3C traceparent, the first one this service saw for the job), so that an
-- event about a job decided while handling another job's event still belongs to its own job's trace.
CREATE TABLE IF NOT EXISTS {s}.job_traces (
    job_id text PRIMARY KEY,
    traceparent text NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.dead_letters (
    id bigserial PRIMARY KEY,
    subject text NOT NULL,
    stream_seq bigint,
    deliveries integer NOT NULL,
    reason text NOT NULL,
    message text NOT NULL,
    body bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""


def first_messages_of_jobs(messages: Sequence[tuple[CloudEvent, Any, str]], kind: type[Payload], *,
                           touching_no_job: tuple[type[Payload], ...] = ()) -> list[str]:
    """For a `ServiceSpec.prefetch` hook: the jobs whose `kind` message a read made at the batch's start answers
    truly, in batch order. That is each job's first message of the batch, up to the first event that names no job
    (what it changes is not known); events of the types `touching_no_job` are passed over, since they touch no job's
    rows."""
    mentioned: set[str] = set()
    served: list[str] = []
    for event, payload, _subject in messages:
        if isinstance(payload, touching_no_job):
            continue
        about = getattr(payload, "job_id", None) or event.subject
        if not isinstance(about, str) or not about:
            break
        if isinstance(payload, kind) and about not in mentioned:
            served.append(about)
        mentioned.add(about)
    return served


class ServiceRuntime:
    """One service instance's plumbing around its handlers. It runs the units of work (one event, or a tick or
    command in `transaction`) and the lifecycle; its parts, each in shared/plumbing/, do the rest: `consumption`
    (the pull consumers and their loops), `batches` (a pulled batch in one transaction), `outbox` (the relay and
    pruning), `dead_letters`, and `leadership` (a singleton's leases, standby and recovery)."""

    def __init__(self, spec: ServiceSpec, *, nats_url: str, pool: asyncpg.Pool, clock: Clock | None = None,
                 instance: str = "0", database_url: str | None = None):
        self.spec = spec
        self.pool = pool
        self.clock = clock or SystemClock()
        self.source = f"gpuq/{spec.name}/{instance}"
        self.counters = Counters()
        self.job_traces = JobTraces()
        # As the URL's bus user (if any), with replies on that user's own inbox prefix (shared/natsauth.py).
        # Reconnecting for as long as NATS is away (the client's default gives up after 60 tries, about two minutes,
        # and leaves a live process that never hears the bus again): an outage costs its length, not the service.
        self.broker = NatsBroker(nats_url, logger=None, connect_timeout=5, inbox_prefix=inbox_prefix_for(nats_url),
                                 max_reconnect_attempts=-1)
        self.state: dict[str, Any] = {}  # service-specific in-memory state (rebuilt by on_start)
        inbox_prefix = inbox_prefix_for(nats_url)  # the pull requests' and publishes' replies
        self.leadership = Leadership(self, database_url)
        self.leases: list[LeaderLease] = self.leadership.leases
        # The first exclusive lease: its term is the fencing token of a service with one scope.
        self.lease: LeaderLease | None = self.leadership.lease
        self.dead_letters = DeadLetterSink(spec.name, spec.schema, pool, self.broker, self.counters)
        self.outbox = OutboxRelay(spec.name, spec.schema, pool, self.broker, self.counters, self.dead_letters,
                                  inbox_prefix)
        self.consumption = Consumption(self, inbox_prefix)
        # (plan, durable name, batch handler) of each durable pull consumer (see Consumption)
        self.consumers = self.consumption.plans
        self.batches = Batches(self)
        self._tasks: list[asyncio.Task[None]] = []
        self._bg_tasks: list[asyncio.Task[None]] = []  # the spec's background loops (paused with consumption)
        self._started = False
        self.handle_lock = asyncio.Lock()  # one unit of work at a time: handlers share the service's memory
        # Where start-up/shutdown is, for health(): see shared/health.py for the phases.
        self.phase = "created"
        self.migrated = False
        self.stale = False  # in-memory state may be ahead of Postgres (a unit of work failed)

    # Settings and counts kept by the parts, read and set here as before the parts existed.

    @property
    def relay_poll_s(self) -> float:
        return self.outbox.poll_s

    @relay_poll_s.setter
    def relay_poll_s(self, seconds: float) -> None:
        self.outbox.poll_s = seconds

    @property
    def retention_s(self) -> float:
        return self.outbox.retention_s

    @property
    def stall_after_s(self) -> float:
        return self.consumption.stall_after_s

    @stall_after_s.setter
    def stall_after_s(self, seconds: float) -> None:
        self.consumption.stall_after_s = seconds

    @property
    def recoveries(self) -> int:
        return self.leadership.recoveries

    @property
    def lease_refusals(self) -> int:
        return self.leadership.lease_refusals

    @property
    def _consumer_tasks(self) -> list[asyncio.Task[None]]:
        return self.consumption.tasks

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """Schema, plumbing tables, migrations, streams. Safe to run on every start."""
        self.phase = "migrating"
        async with self.pool.acquire() as conn, conn.transaction():
            # Instances starting together (sharded services) would race on CREATE ... IF NOT EXISTS.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(f"plumbing-{self.spec.schema}"))
            await conn.execute(PLUMBING_SQL.format(s=self.spec.schema))
        if self.spec.migrations is not None:
            await apply_migrations(self.pool, self.spec.schema, self.spec.migrations)
        self.migrated = True
        self.phase = "connecting"
        await self.broker.connect()
        await ensure_streams(self.broker.config.connection_state.stream)

    async def start(self) -> None:
        await self.prepare()
        if self.leases:
            await self.leadership.campaign()
            self._tasks.append(asyncio.create_task(self.leadership.watch(), name=f"{self.spec.name}-lease"))
        self.phase = "starting"
        if self.spec.on_start is not None:
            await self.spec.on_start(self)
        self._tasks.append(asyncio.create_task(self._relay_loop(), name=f"{self.spec.name}-outbox"))
        await self.broker.start()
        await self.consumption.start()
        self._start_background()
        self._started = True
        self.phase = "running"
        log.info("%s started", self.spec.name)

    def _start_background(self) -> None:
        for loop in self.spec.background:
            self._bg_tasks.append(asyncio.create_task(self._guard(loop), name=f"{self.spec.name}-bg"))

    async def stop(self) -> None:
        self.phase = "stopping"
        await self._cancel(self._tasks)
        await self._cancel(self.consumption.tasks)
        await self._cancel(self._bg_tasks)
        try:
            await asyncio.wait_for(self.broker.stop(), timeout=15)
        except TimeoutError:
            log.warning("%s: the broker did not stop within 15 s; releasing the leases anyway", self.spec.name)
        for lease in reversed(self.leases):
            with contextlib.suppress(Exception):
                await lease.release()
        self._started = False
        self.phase = "stopped"

    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        if tasks:
            # bounded: a task stuck in I/O that ignores its cancellation must not keep the leases held forever
            done, stuck = await asyncio.wait(tasks, timeout=10)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: a crash was logged by the task itself
            for task in stuck:
                log.warning("%s: task %s did not stop within 10 s", self.spec.name, task.get_name())
        tasks.clear()

    async def health(self, *, connections: bool = True) -> ServiceHealth:
        """Readiness facts for /readyz: Postgres answers, NATS is connected, migrations are applied, and the leader
        lease is held (or being waited for, as a standby). Queries nothing on the lease connections: the lease
        watcher uses them. `connections=False` skips the two round trips (liveness must not wait on a server)."""
        checks = {"migrations": Check(ok=self.migrated, detail="applied" if self.migrated else "not applied yet")}
        if connections:
            checks["postgres"], checks["nats"] = await asyncio.gather(
                timed_check(self.pool.fetchval("SELECT 1"), "answers", "Postgres"),
                timed_check(self.broker.ping(timeout=CHECK_TIMEOUT_S / 2), "connected", "NATS"))
        live = True
        if self.leases:
            checks["lease"], live = self.leadership.check()
        consumers: list[ConsumerState] = []
        if connections and self.phase == "running" and self.consumption.watches:
            checks["consumers"], consumers = await self.consumption.check()
        return service_health(self.spec.name, self.phase, checks, live=live, consumers=consumers,
                              dead_letters=self.counters.dead_lettered,
                              dead_letter_reasons=self.counters.dead_letter_reasons)

    async def pause_consumption(self) -> None:
        """Stop the consumers and background loops, keep the NATS connection (the relay publishes on it). A batch
        in flight is cancelled: its transaction rolls back and its messages, never acked, come again."""
        await self._cancel(self.consumption.tasks)
        await self._cancel(self._bg_tasks)

    async def resume_consumption(self) -> None:
        await self.consumption.start()
        self._start_background()

    async def _guard(self, loop: Callable[[ServiceRuntime], Awaitable[None]]) -> None:
        while True:
            try:
                await loop(self)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: background loop crashed; restarting in 1 s", self.spec.name)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ units of work

    @contextlib.asynccontextmanager
    async def transaction(self, traceparent: str | None = None) -> AsyncIterator[Tx]:
        """A unit of work outside event handling (ticks, commands). Outbox rows publish after commit."""
        async with self.handle_lock:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    await self.reload_if_stale(conn)
                    # Outbox rows are written together before the commit (a tick emitting many events, such as
                    # utilisation samples or ETA updates, costs one round trip for them, not one per event).
                    tx = Tx(conn=conn, now=self.clock.now(), source=self.source, schema=self.spec.schema,
                            traceparent=traceparent, job_traces=self.job_traces, buffered=True)
                    yield tx
                    await tx.flush()
            except BaseException as exc:
                self.stale = True
                if isinstance(exc, LostLeadership):
                    self.leadership.depose()
                raise
        self.outbox.wake()

    async def reload_if_stale(self, conn: asyncpg.Connection) -> None:
        if self.stale and self.spec.reload is not None:
            await self.spec.reload(conn)
        self.stale = False

    async def handle(self, raw: bytes, *, subject: str = "", stream_seq: int | None = None,
                     deliveries: int = 1) -> str:
        """Handle one message body in a unit of work of its own. Returns what happened: handled, duplicate, ignored,
        dead_letter. Raises when the handler failed and the message should be retried."""
        verdict: _DeadLetter | None = None
        traces: list[tuple[str, str]] = []
        async with self.handle_lock:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    await self.reload_if_stale(conn)
                    outcome, emitted = await self._unit(conn, raw, subject, None, traces)
            except _DeadLetter as dead:
                self.stale = self.stale or dead.handler_ran
                verdict = dead
            except BaseException:
                self.stale = True  # the handler may have changed memory before the rollback
                raise
        if verdict is not None:
            await self.dead_letter(raw, verdict.subject or subject, stream_seq, deliveries,
                                   verdict.reason, verdict.message)
            return "dead_letter"
        self.job_traces.committed(traces)
        self.count(outcome)
        if emitted:
            self.outbox.wake()
        return outcome

    def count(self, outcome: str) -> None:
        if outcome == "handled":
            self.counters.handled += 1
        elif outcome == "duplicate":
            self.counters.duplicates += 1
        elif outcome == "ignored":
            self.counters.ignored += 1

    def prepare_or_verdict(self, m: Msg) -> _Prepared | _DeadLetter | None:
        """`_prepare` for a consumed message, its verdict returned rather than raised. Nothing that reading a message
        raises escapes: parsing is pure, so any failure is a verdict on the message (dead-lettered at once)."""
        try:
            return self._prepare(m.data, m.subject)
        except _DeadLetter as verdict:
            return verdict
        except Exception as exc:
            return _DeadLetter("Unreadable", f"{type(exc).__name__}: {exc}", handler_ran=False)

    def _prepare(self, raw: bytes, subject: str) -> _Prepared | None:
        """Parse an event and check it may travel on its subject. None: no handler of this service takes its type
        (ignored); raises _DeadLetter for a poison message."""
        try:
            event, payload = parse_event(raw)
        except InvalidEvent as exc:
            raise _DeadLetter(exc.reason, exc.message, handler_ran=False) from exc
        handler = self.spec.handlers.get(type(payload))
        if handler is None:
            return None
        # The subject, not the body, says what an event may be: NATS permissions grant subjects to credentials,
        # so a body whose type does not belong on its subject (a JobPlaced sent on a team's submission subject)
        # is forged. In-process calls without a subject (benchmarks, tests) stand for the event's own subject.
        try:
            subject = subject or default_subject(payload)
            fits = type(payload).scope_of(subject) is not None
        except Exception as exc:  # reading the message, not handling it: it would fail the same way again
            raise _DeadLetter("Unreadable", f"{type(exc).__name__}: {exc}", handler_ran=False) from exc
        if not fits:
            raise _DeadLetter("SubjectMismatch", f"a {event.type} event may not travel on {subject!r} (expected "
                                                 f"{type(payload).subscription()})", handler_ran=False,
                              subject=subject)
        inbox_id = event.id + (self.spec.consumer_suffix if type(payload) in self.spec.broadcast else "")
        return _Prepared(event, payload, handler, subject, inbox_id)

    async def _unit(self, conn: asyncpg.Connection, raw: bytes, subject: str,
                    deferred: dict[str, Callable[[Tx], Awaitable[None]]] | None,
                    traces: list[tuple[str, str]], batch: _BatchWork | None = None,
                    prepared: _Prepared | _DeadLetter | None = _NOT_PREPARED,
                    scratch: dict[str, Any] | None = None, own_savepoint: bool = False) -> tuple[str, bool]:
        """One event's work inside the caller's transaction: parse, check the subject, claim, the inbox row, the
        handler. Returns (outcome, whether it emitted events); raises _DeadLetter for a verdict, anything else
        for a failure worth retrying. Appends to `traces` the job trace rows it wrote (for the cache, after
        the caller committed). In a consumed batch (`batch`), the inbox rows were claimed for the whole batch,
        job trace rows are staged and outbox rows buffered: the batch writes each kind in one round trip."""
        if isinstance(prepared, _DeadLetter):
            raise prepared
        p = self._prepare(raw, subject) if prepared is _NOT_PREPARED else prepared
        if p is None:
            return "ignored", False
        event, payload = p.event, p.payload
        if batch is not None and batch.claimed is not None:
            if not batch.take(p.inbox_id):
                return "duplicate", False
        else:
            if self.spec.claim is not None and not await self.spec.claim(conn, event, payload):
                return "ignored", False
            fresh = await conn.fetchval(
                f"INSERT INTO {self.spec.schema}.inbox(event_id, type) VALUES ($1, $2) "
                "ON CONFLICT DO NOTHING RETURNING true", p.inbox_id, event.type)
            if not fresh:
                return "duplicate", False
        # One span per hop, child of the event's trace context; emitted events carry this span's
        # context, so a job's life from JobSubmitted to JobCompleted is one trace across services.
        with start_span_from_event(event, name=f"{self.spec.name} {BY_TYPE[event.type].__name__}"):
            tx = Tx(conn=conn, now=self.clock.now(), source=self.source, schema=self.spec.schema,
                    traceparent=current_traceparent() or event.traceparent, subject=p.subject,
                    job=event.subject, job_traces=self.job_traces, deferred=deferred, buffered=batch is not None,
                    staged_traces=None if batch is None else batch.traces,
                    scratch={} if scratch is None else scratch, own_savepoint=own_savepoint)
            if event.subject and tx.traceparent:
                if batch is not None:
                    if self.job_traces.stage(event.subject, tx.traceparent, batch.traces):
                        traces.append((event.subject, tx.traceparent))
                elif await self.job_traces.remember(conn, self.spec.schema, event.subject, tx.traceparent):
                    traces.append((event.subject, tx.traceparent))
            try:
                await p.handler(tx, event, payload)
            except Refused as exc:
                raise _DeadLetter(exc.reason, exc.message, handler_ran=True, subject=p.subject) from exc
            if batch is not None:  # only a message whose handler succeeded has rows to write
                batch.rows.extend(tx._rows)
        return "handled", bool(tx.emitted)

    async def retry_or_give_up(self, raw: Msg, exc: BaseException) -> None:
        if isinstance(exc, LostLeadership):
            self.leadership.depose()  # another instance leads: the watcher pauses consumption now (it comes back later)
        meta = raw.metadata
        deliveries = meta.num_delivered
        if refused_data(exc):  # not worth a retry: dead-lettered on this delivery
            await self.dead_letter(raw.data, raw.subject, meta.sequence.stream, deliveries,
                                   "Unstorable", f"{type(exc).__name__}: {exc}")
            await raw.ack()
            return
        if deliveries >= MAX_DELIVER:
            await self.dead_letter(raw.data, raw.subject, meta.sequence.stream, deliveries,
                                   "HandlerFailed", f"{type(exc).__name__}: {exc}")
            await raw.ack()
            return
        self.counters.retried += 1
        # Early retries are routine (events of two streams arrive in no fixed order); repeated ones are not.
        log.log(logging.WARNING if deliveries >= 3 else logging.INFO,
                "%s: handler failed (delivery %d/%d), will retry: %s", self.spec.name, deliveries, MAX_DELIVER, exc)
        await raw.nak(delay=NAK_DELAYS_S[min(deliveries, len(NAK_DELAYS_S)) - 1])

    async def settle_message(self, raw: Msg) -> None:
        """Handle one JetStream message in a unit of work of its own and settle it: ack, nak with delay, or
        dead-letter then ack."""
        meta = raw.metadata
        try:
            await self.handle(raw.data, subject=raw.subject, stream_seq=meta.sequence.stream,
                              deliveries=meta.num_delivered)
        except Exception as exc:
            await self.retry_or_give_up(raw, exc)
            return
        await raw.ack()

    # ------------------------------------------------------------------ the parts' entry points

    def routed(self, subject: str) -> bool:
        """Does a handler of this service take events on `subject`? (Read from the subject alone: a message on a
        subject no handler takes is acked without parsing its body.)"""
        return self.consumption.routed(subject)

    async def _ensure_consumer(self, js: JetStreamContext, plan: ConsumerPlan, durable: str,
                               wanted: tuple[str, ...]) -> None:
        await self.consumption.ensure(js, plan, durable, wanted)

    async def _process_batch(self, msgs: Sequence[Msg]) -> None:
        await self.batches.process(msgs)

    async def dead_letter(self, raw: bytes, subject: str, stream_seq: int | None, deliveries: int,
                          reason: str, message: str) -> None:
        await self.dead_letters.dead_letter(raw, subject, stream_seq, deliveries, reason, message)

    # The relay's passes go through these methods, the seams tests replace (a publish that crashes after
    # publishing, a commit landing just after a pass's query).

    async def _relay_loop(self) -> None:
        await self.outbox.run(self.relay_once, self.prune_once)

    async def relay_once(self, limit: int = RELAY_BATCH) -> int:
        """One relay pass (OutboxRelay.relay_once), publishing through `publish_batch`."""
        return await self.outbox.relay_once(self.publish_batch, limit)

    async def publish_batch(self, messages: Sequence[tuple[str, bytes, str]]) -> dict[str, str]:
        return await self.outbox.publish_batch(messages)

    def max_event_bytes(self) -> int:
        return self.outbox.max_event_bytes()

    async def prune_once(self, retention_s: float | None = None) -> tuple[int, int]:
        return await self.outbox.prune_once(retention_s)


def default_subject(payload: Payload) -> str:
    """The subject of an in-process call that names none (benchmarks, tests): a submission on its own team's
    subject, any other event on its plain subject (so other scoped events must be given theirs)."""
    if isinstance(payload, JobSubmitted) and SCOPE_TOKEN_RE.match(payload.spec.team):
        return payload.scoped_subject(payload.spec.team)
    return payload.subject()


async def publish_event(broker_or_js: Any, event: CloudEvent, subject: str) -> None:
    """Publish one event directly (producers without an outbox: the CLI, pipelines, tests). An event without
    trace context gets one (`shared.tracing.with_trace_context`): nothing gpuq publishes lacks it."""
    event = with_trace_context(event)
    body = encode_event(event)
    headers = {"Nats-Msg-Id": event.id}
    if isinstance(broker_or_js, NatsBroker):
        await broker_or_js.publish(body, subject, headers=headers, stream=stream_for_subject(subject).name,
                                   timeout=5.0)
    else:
        await broker_or_js.publish(subject, body, headers=headers, timeout=5.0)
