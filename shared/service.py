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
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
from faststream.nats import NatsBroker
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as NatsAckPolicy
from nats.js.api import ConsumerConfig as NatsConsumerConfig
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServerError, ServiceUnavailableError

from shared.bus import (
    ConsumerPlan,
    consumer_plan,
    dlq_subject,
    ensure_streams,
    matches,
    stream_for_subject,
    takes_filter_subjects,
)
from shared.clock import Clock, SystemClock
from shared.db import apply_migrations
from shared.events import (
    BY_TYPE,
    MAX_EVENT_BYTES,
    SCOPE_TOKEN_RE,
    CloudEvent,
    EmittedEvent,
    InvalidEvent,
    JobSubmitted,
    Payload,
    encode_event,
    encode_new_event,
    parse_event,
    utcnow_from,
)
from shared.health import CHECK_TIMEOUT_S, Check, ConsumerState, ServiceHealth, service_health, timed_check
from shared.jetstream import BatchPublisher, Puller
from shared.leader import LeaderLease, LostLeadership, lock_key
from shared.natsauth import inbox_prefix_for
from shared.settings import settings
from shared.tracing import (
    current_traceparent,
    outgoing_traceparent,
    start_span_from_event,
    with_trace_context,
)

log = logging.getLogger("gpuq.service")

Handler = Callable[["Tx", CloudEvent, Any], Awaitable[None]]
# A batch handler takes the bodies of one pulled batch and records them in one transaction, inbox rows
# included; it returns an object whose `handled`, `duplicates` and `rest` (bodies it did not take, for the
# per-message path) the runtime reads. For high-rate events (utilisation samples), where one commit per
# message would bound the rate by commit latency.
BatchHandler = Callable[[asyncpg.Connection, Sequence[bytes]], Awaitable[Any]]

MAX_DELIVER = 8
ACK_WAIT_S = 30.0
NAK_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
# How many delivered messages a consumer may hold unacknowledged, those waiting for their redelivery (nak with
# delay) included. JetStream's default, 1,000, let a flood of failing messages (issue 43: 1,500 submissions
# Postgres refused) fill it for their whole backoff, so that nothing behind them was delivered for a minute.
MAX_ACK_PENDING = 20_000
# A consumer that has not settled a batch (nor found nothing to take) for this long while messages wait for it is
# reported not ready by /readyz (GPUQ_CONSUMER_STALL_S): a wedged or blocked consumer must not look healthy.
STALL_ENV = "GPUQ_CONSUMER_STALL_S"
DEFAULT_STALL_S = 60.0
# A dead letter's reason as stored (its `message` column) is cut to this many characters.
DEAD_LETTER_MESSAGE_CHARS = 4096
# Consumption: messages per pull, and how long a pull waits for the first one. A pulled batch is handled in one
# transaction (one savepoint per message) and settled after its commit.
FETCH_BATCH = 256
FETCH_WAIT_S = 1.0
# The savepoint each message of a consumed batch is handled in (shared/service.py _process_batch).
_MESSAGE_SAVEPOINT = "gpuq_message"
# A service with optimistic batches (ServiceSpec.optimistic_batches) handles this many batches with a savepoint per
# message after one of its batches had to be handled again (failures come in runs: a dependency not there yet).
SAVEPOINT_BATCHES_AFTER_FAILURE = 8
# A consumed batch that fails as a whole is bisected (`_bisect`) down to parts of this many messages, then handled
# one by one: halving a part of all-bad messages further would cost more transactions than it saves.
BISECT_PART = 8
# The outbox relay: rows per pipelined batch, and how long the batch's PubAcks may take all together.
RELAY_BATCH = 512
PUBLISH_TIMEOUT_S = 10.0
# `ServiceSpec.batch_linger_s` of the services no decision waits on (telemetry, metering): a status page, a metric
# or a charge that is this much older is no worse, and their batches grow from a few messages to tens at 100 job
# arrivals a second.
READER_LINGER_S = 0.2
# How long the relay waits for a wake-up (a unit of work committed outbox rows) before it looks at the table anyway:
# a backstop for rows committed by another process or instance, not the path of this one's rows.
RELAY_POLL_S = 0.5
HEADER_ROOM = 4096  # bytes kept free below max_payload for the message's headers (Nats-Msg-Id, trace context)
# An event body's own limit (the server's max_payload, 1 MiB by default, minus HEADER_ROOM applies as well).
EVENT_BYTES_LIMIT = MAX_EVENT_BYTES
DLQ_BODY_BYTES = 64 * 1024  # the body a dead letter's bus notice carries (the table row keeps all of it)
# Published outbox rows and inbox rows are kept this long, then pruned (GPUQ_PLUMBING_RETENTION_S). The inbox must
# outlive every redelivery of an event (max_deliver x ack_wait plus backoff: minutes) and the publish duplicate
# window, so the setting has a floor of one hour.
RETENTION_ENV = "GPUQ_PLUMBING_RETENTION_S"
DEFAULT_RETENTION_S = 7 * 86_400.0
MIN_RETENTION_S = 3_600.0
PRUNE_EVERY_S = 300.0
PRUNE_BATCH = 10_000


def stall_after_from_env(env: Mapping[str, str] = os.environ) -> float:
    """GPUQ_CONSUMER_STALL_S: seconds without progress, messages waiting, before a consumer counts as stalled."""
    return settings(env).consumer_stall_s


def refused_data(exc: BaseException) -> bool:
    """Did Postgres refuse the data itself (SQLSTATE class 22, a data exception: a NUL, an invalid byte sequence, a
    number out of range; class 54, a limit exceeded: an index entry too large), or the driver find no encoding for it
    (a lone surrogate, an integer wider than its column)? The same message then fails the same way on every
    delivery: retrying it only holds up what comes after it."""
    return isinstance(exc, asyncpg.DataError | asyncpg.ProgramLimitExceededError | UnicodeEncodeError) or (
        isinstance(exc, asyncpg.InterfaceError) and isinstance(exc, ValueError))  # an argument it cannot encode


def _storable_text(text: str, limit: int | None = None) -> str:
    """`text` as a text column takes it: NULs and lone surrogates escaped (a dead letter's reason may quote what it
    refuses), cut to `limit` characters."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def retention_from_env(env: Mapping[str, str] = os.environ) -> float:
    """The plumbing retention in seconds from GPUQ_PLUMBING_RETENTION_S (default 7 days, at least one hour)."""
    return settings(env).plumbing_retention_s
# How often a singleton checks its lease connections; how long Postgres may stay unreachable while the runtime
# takes its leases again before /healthz says "not live" (a supervisor then restarts the process: waiting longer
# in-process would not bring Postgres back sooner, but a restart clears whatever else went wrong).
LEASE_CHECK_S = 2.0
LEASE_RECOVERY_BOUND_S = 300.0

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


class _DeadLetter(Exception):  # a verdict on one message inside the runtime: dead-letter it, never retry
    def __init__(self, reason: str, message: str, *, handler_ran: bool, subject: str = ""):
        self.reason = reason
        self.message = message
        self.handler_ran = handler_ran  # memory may have changed before the rollback
        self.subject = subject  # the subject the event stands for (an in-process call names none)
        super().__init__(f"{reason}: {message}")


class Refused(Exception):  # a verdict, not a failure: the event is dead-lettered with the reason
    """Raised by a handler that refuses an event it must not act on (a forged or stale placement, ...): the unit of
    work rolls back and the event is dead-lettered at once with `reason` and `message`, never retried."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


@dataclass
class _Prepared:
    """A message parsed and checked against its subject, ready for its handler."""

    event: CloudEvent
    payload: Payload
    handler: Handler
    subject: str
    inbox_id: str


_NOT_PREPARED: Any = object()  # `_unit` parses the message itself


class _Optimism(Exception):  # a handler failed in a batch handled without savepoints: roll back, try with them
    pass


@dataclass
class _BatchResult:
    """What one attempt at a consumed batch decided, settled after its commit."""

    outcomes: list[tuple[Msg, str, BaseException | None]] = field(default_factory=list)
    dead: list[tuple[Msg, _DeadLetter]] = field(default_factory=list)
    traces: list[tuple[str, str]] = field(default_factory=list)  # job trace rows written (cached after the commit)
    emitted: bool = False
    scratch: dict[str, Any] = field(default_factory=dict)  # shared by the attempt's units of work (Tx.scratch)


@dataclass
class _BatchWork:
    """What a consumed batch writes once for all its messages instead of once per message: the inbox rows (claimed
    together before the first handler runs: `claimed` holds the ids this batch inserted, None where the service
    claims per message), the job trace rows its messages staged, and the outbox rows its handlers emitted."""

    claimed: set[str] | None
    traces: dict[str, str] = field(default_factory=dict)
    rows: list[tuple[str, str, bytes]] = field(default_factory=list)

    def take(self, inbox_id: str) -> bool:
        """Is this the message that claimed `inbox_id`? (A copy later in the same batch is a duplicate.)"""
        if self.claimed is not None and inbox_id in self.claimed:
            self.claimed.discard(inbox_id)
            return True
        return False


@dataclass
class Tx:
    """One unit of work: the open transaction, the clock reading, and the outbox writer. `subject` is the subject
    the handled event arrived on (its scope token names the team of a submission: see Payload.scope)."""

    conn: asyncpg.Connection
    now: float
    source: str
    schema: str
    traceparent: str | None = None
    emitted: list[EmittedEvent] = field(default_factory=list)
    subject: str = ""  # the NATS subject the handled event arrived on (its scope token names the team)
    job: str | None = None  # the job the handled event is about (its CloudEvents `subject`), if any
    job_traces: JobTraces | None = None
    # Work a handler asks to run once after every event of the unit of work (a batch of messages shares one
    # transaction): key -> callable. None: a unit of one event, whose deferred work runs at once.
    deferred: dict[str, Callable[[Tx], Awaitable[None]]] | None = None
    # Outbox rows held until `flush` (one round trip to Postgres for all, in order) instead of one INSERT per
    # event: the runtime buffers its batch-end cycles (a cycle admits or places many jobs), and flushes before commit.
    buffered: bool = False
    _rows: list[tuple[str, str, bytes]] = field(default_factory=list)
    # In a consumed batch: job trace rows staged by the batch's messages, written at its end (JobTraces.stage).
    staged_traces: dict[str, str] | None = None
    # Job trace rows this transaction wrote (the table's rows, as RETURNING gave them): the work deferred to a
    # batch's end reads a job's trace here first, instead of asking Postgres for a row the batch just wrote.
    written_traces: Mapping[str, str] | None = None
    # Handler-owned scratch space shared by every unit of work of one transaction (a consumed batch's messages and
    # the work deferred to its end; a unit of one event has its own): a handler gathers rows here and writes them
    # once in its `after_events` work. A message whose savepoint rolls back must have added nothing that its
    # failure undoes, so a handler adds to it last; a batch attempt that rolls back as a whole drops all of it.
    scratch: dict[str, Any] = field(default_factory=dict)
    # The handled message runs in a savepoint of its own (a batch handled with savepoints): a later message's
    # failure rolls back only that message, so rows this one leaves in `scratch` for a later reader (or for the
    # batch's end) to write could be lost with it. A handler writes at once then. False: any failure of the unit's
    # handlers rolls its whole transaction back (a unit of one event, a batch handled without savepoints), so rows
    # held for the batch's end are safe as long as whoever reads the table first writes them.
    own_savepoint: bool = False

    @property
    def may_hold_rows(self) -> bool:
        """May a handler leave rows in `scratch` for the batch's end? Only where there is a batch end to write them at
        and any failure rolls the whole transaction back (not `own_savepoint`)."""
        return self.deferred is not None and not self.own_savepoint

    async def flush(self) -> None:
        """Write the buffered outbox rows (in emission order, so the relay publishes them in that order)."""
        if self._rows:
            rows, self._rows = self._rows, []
            await insert_outbox_rows(self.conn, self.schema, rows)

    async def after_events(self, key: str, work: Callable[[Tx], Awaitable[None]]) -> None:
        """Run `work` once after the events of this unit of work are applied, in its transaction: at once for a unit
        of one event, else once per batch whatever the number of events that asked (a scheduling cycle after a
        batch of admissions sees them all, instead of one cycle per event)."""
        if self.deferred is None:
            await work(self)
        else:
            self.deferred.setdefault(key, work)

    async def emit(self, payload: Payload, subject_suffix: str | None = None,
                   traceparent: str | None = None) -> EmittedEvent:
        """Write `payload` to the outbox, in trace context (shared/tracing.py): `traceparent` when given; for an
        event about the job being handled, the handling span's; for another job, that job's own trace (a cycle
        run for one job's event admits or places others); else the unit of work's, or a new trace. Scoped events
        (AuditRecorded) take their scope token as `subject_suffix`."""
        job = payload.job_key()
        if traceparent is None and job is not None and job != self.job:
            traceparent = self.written_traces.get(job) if self.written_traces else None
            if traceparent is None:
                traceparent = await (self.job_traces or JobTraces()).get(self.conn, self.schema, job,
                                                                         self.staged_traces)
        event_id, body = encode_new_event(payload, source=self.source, time=utcnow_from(self.now),
                                          traceparent=outgoing_traceparent(traceparent or self.traceparent))
        subject = (payload.scoped_subject(subject_suffix) if payload.scope and subject_suffix else
                   payload.subject() + (f".{subject_suffix}" if subject_suffix else ""))
        row = (event_id, subject, body)
        if self.buffered:
            self._rows.append(row)
        else:
            await insert_outbox_rows(self.conn, self.schema, [row])
        event = EmittedEvent(event_id, body, payload)
        self.emitted.append(event)
        return event


async def insert_outbox_rows(conn: asyncpg.Connection, schema: str, rows: Sequence[tuple[str, str, bytes]]) -> None:
    """Write (event id, subject, body) outbox rows in their order (their `seq`, the order the relay publishes them
    in) with one statement: one row per array element, taken in the arrays' order. (`executemany` binds and
    executes the statement once per row: about a third more Postgres CPU per row at a consumed batch's hundreds.)"""
    await conn.execute(
        f"INSERT INTO {schema}.outbox(event_id, subject, body) SELECT e, s, b FROM unnest($1::text[], $2::text[], "
        "$3::bytea[]) WITH ORDINALITY AS u(e, s, b, n) ORDER BY n",
        [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


class JobTraces:
    """Each job's trace context as this service first saw it (`<schema>.job_traces`), with a bounded cache: a
    job's entry never changes once written, so a cached one is never stale."""

    def __init__(self, cache_size: int = 100_000):
        self.cache: OrderedDict[str, str] = OrderedDict()
        self.cache_size = cache_size

    def _keep(self, job_id: str, traceparent: str) -> None:
        self.cache[job_id] = traceparent
        self.cache.move_to_end(job_id)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    async def remember(self, conn: asyncpg.Connection, schema: str, job_id: str, traceparent: str) -> bool:
        """Write the job's first trace context unless the cache knows it. Returns whether it inserted: the caller
        passes what was written to `committed` once its transaction committed (cached only then: a rolled back
        row was never written), so a job's later events cost no round trip to Postgres."""
        if job_id in self.cache:
            return False
        # RETURNING: only a row this call inserted is cached (one written before a restart may differ)
        return bool(await conn.fetchval(f"INSERT INTO {schema}.job_traces(job_id, traceparent) VALUES ($1, $2) "
                                        "ON CONFLICT DO NOTHING RETURNING true", job_id, traceparent))

    def stage(self, job_id: str, traceparent: str, staged: dict[str, str]) -> bool:
        """Batch form of `remember`: the row is staged (written by `write_staged` at the batch's end, one round trip
        for the batch) unless the cache or an earlier message of the batch knows the job. Returns whether it was
        staged; the caller drops what a message staged if that message's savepoint rolls back."""
        if job_id in self.cache or job_id in staged:
            return False
        staged[job_id] = traceparent
        return True

    async def write_staged(self, conn: asyncpg.Connection, schema: str,
                           staged: Mapping[str, str]) -> list[tuple[str, str]]:
        """Insert the staged rows; returns those this call inserted (a row written before, e.g. before a restart,
        is kept and not cached from the staged value), for `committed` after the commit."""
        if not staged:
            return []
        jobs = sorted(staged)
        rows = await conn.fetch(
            f"INSERT INTO {schema}.job_traces(job_id, traceparent) "
            "SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING RETURNING job_id, traceparent",
            jobs, [staged[j] for j in jobs])
        return [(r["job_id"], r["traceparent"]) for r in rows]

    def committed(self, written: Sequence[tuple[str, str]]) -> None:
        """After commit: the rows `remember` wrote are in the table. The first one written for a job wins (ON
        CONFLICT DO NOTHING), so a job already cached keeps its entry."""
        for job_id, traceparent in written:
            if job_id not in self.cache:
                self._keep(job_id, traceparent)

    async def get(self, conn: asyncpg.Connection, schema: str, job_id: str,
                  staged: Mapping[str, str] | None = None) -> str | None:
        found = self.cache.get(job_id)
        if found is None:
            found = await conn.fetchval(f"SELECT traceparent FROM {schema}.job_traces WHERE job_id = $1", job_id)
            if found is not None:
                self._keep(job_id, found)
            elif staged is not None:  # first seen earlier in this batch: its row is written at the batch's end
                found = staged.get(job_id)
        return found


@dataclass
class ServiceSpec:
    name: str
    schema: str
    handlers: Mapping[type[Payload], Handler]
    migrations: Path | None = None
    # Called once after migrations, before consuming: load in-memory state from the service's tables.
    on_start: Callable[[ServiceRuntime], Awaitable[None]] | None = None
    # Long-running loops (ticks, simulated executors), started after consuming begins, cancelled on stop.
    background: Sequence[Callable[[ServiceRuntime], Awaitable[None]]] = ()
    # Handle events one at a time, in stream order (the cores rely on per-job ordering).
    max_workers: int = 1
    consumer_suffix: str = ""
    # Single active instance: consume only while holding the leader lease (standbys wait).
    singleton: bool = False
    # A singleton's leases, by scope: empty = one exclusive lease named after the service. `shared_lease_scopes`
    # are held in shared mode (they exclude an exclusive holder of the same scope, not each other). All are
    # acquired before consuming, shared ones first, then exclusive ones in the given order; callers list them
    # sorted, so that instances with overlapping scopes never wait on each other in a cycle.
    lease_scopes: Sequence[str] = ()
    shared_lease_scopes: Sequence[str] = ()
    # Ownership, for services whose instances each serve part of the events (sharding): called in the unit of
    # work's transaction before the inbox row is written; False = not this instance's event, acked with nothing
    # recorded (so that the instance that owns it, now or later, still handles it).
    claim: Callable[[asyncpg.Connection, CloudEvent, Any], Awaitable[bool]] | None = None
    # Event types that every instance of a sharded service handles (configuration, inventory): their inbox row
    # is keyed by event id + consumer_suffix, so one instance's record does not hide the event from another.
    # Other events keep the plain event id: whichever instance owns one records it, once.
    broadcast: frozenset[type[Payload]] = frozenset()
    # Event types whose consumer pulls batches and hands them to one BatchHandler (see BatchHandler).
    batch_handlers: Mapping[type[Payload], BatchHandler] = field(default_factory=dict)
    # Rebuilds the service's in-memory state from its tables. Called at the start of the next unit of work
    # after one failed: a handler may have changed memory before its transaction rolled back.
    reload: Callable[[asyncpg.Connection], Awaitable[None]] | None = None
    # Handle a consumed batch without a savepoint per message (one round trip to Postgres less per message); if a
    # handler fails or refuses, the batch rolls back as a whole and is handled again with savepoints (as are the
    # next SAVEPOINT_BATCHES_AFTER_FAILURE batches). Only for a service whose memory `reload` rebuilds, or that
    # keeps none a second application of an event would change (its earlier messages are applied again).
    optimistic_batches: bool = False
    # How long a consumer waits for more messages once a batch's first has come (seconds; 0: it handles what has
    # come at once). For services whose readers can wait that long (telemetry's read models and metrics,
    # metering's charges): bigger batches, so fewer transactions and less CPU and Postgres work per event, which
    # leaves more of both to the services on a job's path to its placement; those keep 0, as every hop counts.
    batch_linger_s: float = 0.0
    # Called once per attempt at a consumed batch, after its inbox rows are claimed and before its first handler,
    # with the messages whose handlers will run (event, payload, subject; in handling order) and the batch's
    # scratch (Tx.scratch): a service may read in one statement what its handlers would otherwise read one round
    # trip each. What it leaves there must stay true for each message it serves while the batch's earlier messages
    # are handled (the service's to ensure, e.g. by serving only a job's first message of the batch). Messages
    # handled one by one (a single delivery, or a batch that failed as a whole) come without it.
    prefetch: Callable[[asyncpg.Connection, Sequence[tuple[CloudEvent, Any, str]], dict[str, Any]],
                       Awaitable[None]] | None = None


@dataclass
class Counters:
    handled: int = 0
    duplicates: int = 0
    ignored: int = 0
    retried: int = 0
    dead_lettered: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)  # dead_lettered per reason, for /metrics
    published: int = 0
    batches: int = 0  # pulled batches committed as one unit of work
    batch_retries: int = 0  # batches handled without savepoints that rolled back and were handled again with them

    def count_dead_letter(self, reason: str) -> None:
        self.dead_lettered += 1
        self.dead_letter_reasons[reason] = self.dead_letter_reasons.get(reason, 0) + 1


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


@dataclass
class _ConsumerWatch:
    """One consumer's pull loop as health() judges it: whether it still runs, and when it last settled a batch or
    found nothing to take (monotonic seconds)."""

    stream: str
    durable: str
    progress_at: float
    task: asyncio.Task[None]
    blocked_since: float | None = None  # first seen unable to take more (its unacknowledged messages at the limit)


def _settled(m: Msg) -> bool:
    """Was `m` acked, nak'd or terminated? (nats-py marks it so, and refuses to settle it twice.)"""
    return bool(getattr(m, "_ackd", False))


def _filters_of(config: NatsConsumerConfig) -> tuple[str, ...]:
    """A consumer's filter subjects, however given: `filter_subjects` (NATS >= 2.10) or `filter_subject`; empty:
    the whole stream."""
    if config.filter_subjects:
        return tuple(sorted(config.filter_subjects))
    return (config.filter_subject,) if config.filter_subject else ()


def _with_filters(config: NatsConsumerConfig, filters: tuple[str, ...]) -> NatsConsumerConfig:
    """`config` filtering on `filters`: one as `filter_subject` (every NATS version), several as `filter_subjects`
    (NATS >= 2.10). The server refuses both at once, so the other field is cleared (None: not sent)."""
    if len(filters) == 1:
        return replace(config, filter_subject=filters[0], filter_subjects=None)
    return replace(config, filter_subject=None, filter_subjects=list(filters))


class ServiceRuntime:
    def __init__(self, spec: ServiceSpec, *, nats_url: str, pool: asyncpg.Pool, clock: Clock | None = None,
                 instance: str = "0", database_url: str | None = None):
        self.spec = spec
        self.leases: list[LeaderLease] = []
        if spec.singleton:
            if database_url is None:
                raise ValueError(f"{spec.name} is a singleton service: pass database_url for its leader lease")
            self.leases = [LeaderLease(database_url, spec.schema, scope, shared=True)
                           for scope in spec.shared_lease_scopes]
            self.leases += [LeaderLease(database_url, spec.schema, scope)
                            for scope in (spec.lease_scopes or (spec.name,))]
        # The first exclusive lease: its term is the fencing token of a service with one scope.
        self.lease: LeaderLease | None = next((lease for lease in self.leases if not lease.shared), None)
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
        self._outbox_wakeup = asyncio.Event()
        self.relay_poll_s = RELAY_POLL_S
        self.retention_s = retention_from_env()
        self.event_bytes_limit = EVENT_BYTES_LIMIT
        self._tasks: list[asyncio.Task[None]] = []
        self._bg_tasks: list[asyncio.Task[None]] = []  # the spec's background loops (paused with consumption)
        self._consumer_tasks: list[asyncio.Task[None]] = []  # one pull loop per durable consumer (paused too)
        self._watches: dict[str, _ConsumerWatch] = {}  # durable name -> its loop's progress, for health()
        self.stall_after_s = stall_after_from_env()
        self._unreachable_since: float | None = None  # monotonic time since when the leases' Postgres is unreachable
        self.recovery_bound_s = LEASE_RECOVERY_BOUND_S
        self.recoveries = 0  # times the leases were lost and taken again
        self._deposed = asyncio.Event()  # set when a fence check failed: the watcher recovers at once
        self._started = False
        self._handle_lock = asyncio.Lock()
        # Where start-up/shutdown is, for health(): see shared/health.py for the phases.
        self.phase = "created"
        self.lease_refusals = 0  # attempts at a lease that found another instance holding it
        self.migrated = False
        self._stale = False  # in-memory state may be ahead of Postgres (a unit of work failed)
        self._savepoint_batches = 0  # batches left to handle with savepoints after an optimistic one failed
        batch_subjects = {cls.subject(): fn for cls, fn in spec.batch_handlers.items()}
        # (plan, durable name, batch handler): one durable pull consumer each, pulled by this runtime's own loop
        # (`_consume`), which settles each message itself in stream order. A batch handler takes a consumer whose
        # one subject is its event type's. What a consumer filters on depends on the server (`_start_consumers`).
        self.consumers: list[tuple[ConsumerPlan, str, BatchHandler | None]] = [
            (plan, f"{spec.name}{spec.consumer_suffix}-{plan.suffix}",
             batch_subjects.get(plan.subjects[0]) if len(plan.subjects) == 1 else None)
            for plan in consumer_plan([*spec.handlers, *spec.batch_handlers])]
        # The subscriptions of the handled types: a message on any other subject of a consumer's filter is acked
        # unread (routing on the subject, before any parsing).
        self.routes = tuple(sorted({cls.subscription() for cls in spec.handlers}))
        self._routed: dict[str, bool] = {}
        self._inbox_prefix = inbox_prefix_for(nats_url)  # the pull requests' and publishes' replies
        self._publisher: BatchPublisher | None = None

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
            await self._campaign()
            self._tasks.append(asyncio.create_task(self._watch_lease(), name=f"{self.spec.name}-lease"))
        self.phase = "starting"
        if self.spec.on_start is not None:
            await self.spec.on_start(self)
        self._tasks.append(asyncio.create_task(self._relay_loop(), name=f"{self.spec.name}-outbox"))
        await self.broker.start()
        await self._start_consumers()
        self._start_background()
        self._started = True
        self.phase = "running"
        log.info("%s started", self.spec.name)

    async def _campaign(self) -> None:
        """Take every lease, in order (a standby waits here holding only the leases before). Postgres being
        unreachable is retried with a capped backoff (shared/leader.py): phase "recovering" while it cannot be
        asked, "standby" while another instance holds a lease."""
        self.phase = "standby"

        def attempted(error: BaseException | None) -> None:
            if error is None:
                self.lease_refusals += 1  # another instance holds it: `gpuq up` says STANDBY only then
                self.phase, self._unreachable_since = "standby", None
            else:
                self.phase = "recovering"
                if self._unreachable_since is None:
                    self._unreachable_since = time.monotonic()
        # Leases already taken must not sit idle past their TTL while a later one is waited for.
        async with self._leases_kept_alive():
            for lease in self.leases:
                await lease.acquire(on_attempt=attempted)
        self._unreachable_since = None

    def _start_background(self) -> None:
        for loop in self.spec.background:
            self._bg_tasks.append(asyncio.create_task(self._guard(loop), name=f"{self.spec.name}-bg"))

    async def stop(self) -> None:
        self.phase = "stopping"
        await self._cancel(self._tasks)
        await self._cancel(self._consumer_tasks)
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
            if self.phase == "standby":
                held = sum(lease.held for lease in self.leases)
                checks["lease"] = Check(ok=True, detail=f"standing by ({held} of {len(self.leases)} leases held)")
            elif self.phase == "recovering":
                # Consumption is paused and the leases are being taken again (the watcher campaigns): not ready.
                # Live while that is worth waiting for; a Postgres unreachable for longer than the recovery bound
                # makes it not live, so that a supervisor restarts the process (LEASE_RECOVERY_BOUND_S).
                down = time.monotonic() - self._unreachable_since if self._unreachable_since is not None else 0.0
                live = down <= self.recovery_bound_s
                checks["lease"] = Check(ok=False, detail=f"recovering: Postgres unreachable for {down:.0f} s, "
                                                         "taking the leases again")
            elif self.phase in ("starting", "running"):
                lost = sorted(lease.scope for lease in self.leases if not lease.held)
                checks["lease"] = Check(ok=not lost, detail=f"lost: {', '.join(lost)}" if lost else
                                        f"held (term {self.lease.term if self.lease else '-'})")
            else:
                checks["lease"] = Check(ok=False, detail="not held")
        consumers: list[ConsumerState] = []
        if connections and self.phase == "running" and self._watches:
            checks["consumers"], consumers = await self._consumers_health()
        return service_health(self.spec.name, self.phase, checks, live=live, consumers=consumers,
                              dead_letters=self.counters.dead_lettered,
                              dead_letter_reasons=self.counters.dead_letter_reasons)

    async def _consumers_health(self) -> tuple[Check, list[ConsumerState]]:
        """Is every consumer advancing? Not when its loop has stopped; nor when messages wait for it (the server's
        count: not yet delivered, or delivered and unacknowledged) and it has neither settled a batch nor found
        nothing to take for `stall_after_s` (a handler stuck, a loop wedged); nor when it has been unable to take
        more for that long (as many delivered messages unacknowledged as the consumer allows, others behind them:
        a flood of failing messages waiting out their backoff). One consumer-info request per consumer."""
        js = self.broker.config.connection_state.stream
        watches = list(self._watches.values())
        infos = await asyncio.gather(*(asyncio.wait_for(js.consumer_info(w.stream, w.durable), CHECK_TIMEOUT_S)
                                       for w in watches), return_exceptions=True)
        now = time.monotonic()
        states: list[ConsumerState] = []
        problems: list[str] = []
        for watch, info in zip(watches, infos, strict=True):
            idle = now - watch.progress_at
            waiting: int | None = None
            problem: str | None = None
            if watch.task.done():
                error = None if watch.task.cancelled() else watch.task.exception()
                problem = f"{watch.durable}: its loop has stopped" + (
                    f" ({type(error).__name__}: {error})" if error is not None else "")
            if isinstance(info, BaseException):
                info = None  # no answer: the NATS check says why; judged on what the loop knows
            if info is not None:
                pending, unacked = info.num_pending or 0, info.num_ack_pending or 0
                waiting = pending + unacked
                limit = info.config.max_ack_pending
                full = pending > 0 and limit is not None and 0 < limit <= unacked
                watch.blocked_since = (watch.blocked_since or now) if full else None
                if problem is None and waiting > 0 and idle > self.stall_after_s:
                    problem = f"{watch.durable}: no progress for {idle:.0f} s with {waiting} messages waiting"
                elif problem is None and watch.blocked_since is not None \
                        and now - watch.blocked_since > self.stall_after_s:
                    problem = (f"{watch.durable}: takes nothing new for {now - watch.blocked_since:.0f} s: {unacked} "
                               f"delivered messages unacknowledged (its limit), {pending} waiting behind them")
            if problem is not None:
                problems.append(problem)
            states.append(ConsumerState(consumer=watch.durable, waiting=waiting, since_progress_s=idle,
                                        stalled=problem is not None))
        if problems:
            return Check(ok=False, detail="; ".join(problems)), states
        return Check(ok=True, detail=f"{len(watches)} advancing"), states

    async def _watch_lease(self) -> None:
        """Stop consuming the moment a lease connection is gone (another instance may lead now), then campaign
        again: a restarted Postgres, or a network blip, costs a pause, never a live process that does nothing.
        The NATS connection stays up meanwhile, so the outbox relay keeps publishing what was committed."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deposed.wait(), timeout=LEASE_CHECK_S)
            if self._deposed.is_set():  # a unit of work found its fence superseded: another instance leads
                lost = [lease.scope for lease in self.leases if not lease.shared]
            else:
                lost = [lease.scope for lease in self.leases if not await lease.alive()]
            if not lost:
                continue
            self._deposed.clear()
            log.error("%s: lost the leader lease %s; pausing consumption and taking the leases again",
                      self.spec.name, ", ".join(lost))
            while True:  # the recovery itself may meet the outage again: it starts over until it succeeds
                try:
                    await self._recover()
                    break
                except Exception:
                    log.exception("%s: recovery failed; starting it over in 1 s", self.spec.name)
                    await asyncio.sleep(1.0)

    async def _recover(self) -> None:
        """Pause consumption, give every lease back, take them again, reload memory from the tables, resume."""
        self.phase = "recovering"
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
        await self._pause_consumption()
        for lease in reversed(self.leases):  # all of them: the leases are taken in order, or not at all
            with contextlib.suppress(Exception):
                await lease.release()
        self._stale = True  # another instance may have led meanwhile: memory is rebuilt from the tables
        await self._campaign()
        self.phase = "starting"
        if self.spec.on_start is not None:
            # The lease sessions must not sit idle past their TTL while the state reloads.
            async with self._leases_kept_alive():
                await self.spec.on_start(self)
        self._stale = False
        await self._resume_consumption()
        self.recoveries += 1
        self.phase = "running"
        log.warning("%s: leader again (term %s); consuming", self.spec.name,
                    self.lease.term if self.lease else "-")

    @contextlib.asynccontextmanager
    async def _leases_kept_alive(self) -> AsyncIterator[None]:
        """Query the held leases every few seconds while the body runs, so that none sits idle past its TTL. The
        keeper is stopped between queries, never cancelled inside one: a query cancelled half-way leaves its
        connection unusable for the next one (the watcher's)."""
        done = asyncio.Event()

        async def keep() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=LEASE_CHECK_S)
                if done.is_set():
                    return
                for lease in self.leases:
                    if lease.held:  # never the one being acquired: its connection is busy with that
                        await lease.alive()

        keeper = asyncio.create_task(keep())
        try:
            yield
        finally:
            done.set()
            await asyncio.wait({keeper}, timeout=10)
            if not keeper.done():
                keeper.cancel()

    async def _pause_consumption(self) -> None:
        """Stop the consumers and background loops, keep the NATS connection (the relay publishes on it). A batch
        in flight is cancelled: its transaction rolls back and its messages, never acked, come again."""
        await self._cancel(self._consumer_tasks)
        await self._cancel(self._bg_tasks)

    async def _resume_consumption(self) -> None:
        await self._start_consumers()
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
        async with self._handle_lock:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    await self._reload_if_stale(conn)
                    # Outbox rows are written together before the commit (a tick emitting many events, such as
                    # utilisation samples or ETA updates, costs one round trip for them, not one per event).
                    tx = Tx(conn=conn, now=self.clock.now(), source=self.source, schema=self.spec.schema,
                            traceparent=traceparent, job_traces=self.job_traces, buffered=True)
                    yield tx
                    await tx.flush()
            except BaseException as exc:
                self._stale = True
                if isinstance(exc, LostLeadership):
                    self._deposed.set()
                raise
        self._outbox_wakeup.set()

    async def _reload_if_stale(self, conn: asyncpg.Connection) -> None:
        if self._stale and self.spec.reload is not None:
            await self.spec.reload(conn)
        self._stale = False

    async def handle(self, raw: bytes, *, subject: str = "", stream_seq: int | None = None,
                     deliveries: int = 1) -> str:
        """Handle one message body in a unit of work of its own. Returns what happened: handled, duplicate, ignored,
        dead_letter. Raises when the handler failed and the message should be retried."""
        verdict: _DeadLetter | None = None
        traces: list[tuple[str, str]] = []
        async with self._handle_lock:
            try:
                async with self.pool.acquire() as conn, conn.transaction():
                    await self._reload_if_stale(conn)
                    outcome, emitted = await self._unit(conn, raw, subject, None, traces)
            except _DeadLetter as dead:
                self._stale = self._stale or dead.handler_ran
                verdict = dead
            except BaseException:
                self._stale = True  # the handler may have changed memory before the rollback
                raise
        if verdict is not None:
            await self.dead_letter(raw, verdict.subject or subject, stream_seq, deliveries,
                                   verdict.reason, verdict.message)
            return "dead_letter"
        self.job_traces.committed(traces)
        self._count(outcome)
        if emitted:
            self._outbox_wakeup.set()
        return outcome

    def _count(self, outcome: str) -> None:
        if outcome == "handled":
            self.counters.handled += 1
        elif outcome == "duplicate":
            self.counters.duplicates += 1
        elif outcome == "ignored":
            self.counters.ignored += 1

    def _prepare_or_verdict(self, m: Msg) -> _Prepared | _DeadLetter | None:
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

    def routed(self, subject: str) -> bool:
        """Does a handler of this service take events on `subject`? (Read from the subject alone: a message on a
        subject no handler takes is acked without parsing its body.)"""
        known = self._routed.get(subject)
        if known is None:  # subjects repeat (one per event type and team): decide each once
            known = self._routed[subject] = any(matches(pattern, subject) for pattern in self.routes)
            if len(self._routed) > 10_000:  # bounded (team names come from publishers)
                self._routed.clear()
        return known

    # ------------------------------------------------------------------ consumption

    async def _start_consumers(self) -> None:
        """Create the durable pull consumers that do not exist yet (an existing one is kept: its pending messages
        are the service's), then pull each in a task of its own.

        A consumer filters on exactly the subjects the service's handlers take of its stream pattern: one subject,
        or several where the server takes several filters (NATS >= 2.10, read from the connection's server info),
        else the pattern itself (NATS 2.9: the subjects no handler takes are acked unread, `routed`).

        An existing consumer whose filter is not the one the handlers call for now (the service handles more or
        fewer event types of that stream than when the consumer was made, or the server was upgraded to take
        several filters) has its filter updated in place, between `filter_subject` and `filter_subjects` either
        way: JetStream keeps its position, so it goes on from where it was, receiving what the handlers take. A
        server that refuses the update leaves the consumer as it was (a wider filter only costs deliveries acked
        unread)."""
        js = self.broker.config.connection_state.stream
        version = self.broker.config.connection_state.connection.connected_server_version
        multi_filter = takes_filter_subjects(version.major, version.minor)
        for plan, durable, _ in self.consumers:
            await self._ensure_consumer(js, plan, durable, plan.filters(multi_filter))
        for plan, durable, batch_fn in self.consumers:
            task = asyncio.create_task(
                self._consume(plan.stream.name, " ".join(plan.filters(multi_filter)), durable, batch_fn),
                name=f"{self.spec.name}-consume-{durable}")
            self._watches[durable] = _ConsumerWatch(plan.stream.name, durable, time.monotonic(), task)
            self._consumer_tasks.append(task)

    async def _ensure_consumer(self, js: JetStreamContext, plan: ConsumerPlan, durable: str,
                               wanted: tuple[str, ...]) -> None:
        """Create consumer `durable` filtering on `wanted`, or bring an existing one's filter to it in place."""
        stream = plan.stream.name
        try:
            info = await js.consumer_info(stream, durable)
        except NotFoundError:
            info = await js.add_consumer(stream, _with_filters(NatsConsumerConfig(
                durable_name=durable, ack_policy=NatsAckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                max_deliver=MAX_DELIVER, ack_wait=ACK_WAIT_S, max_ack_pending=MAX_ACK_PENDING), wanted))
            self._check_filters(durable, _filters_of(info.config), wanted)
            return
        had = _filters_of(info.config)
        limit = info.config.max_ack_pending
        roomy = limit is not None and (limit < 0 or limit >= MAX_ACK_PENDING)  # -1: no limit
        if had == wanted and roomy:
            return
        # A consumer made before MAX_ACK_PENDING gets it in place too (JetStream updates it, keeping its position).
        config = _with_filters(info.config, wanted) if roomy else \
            replace(_with_filters(info.config, wanted), max_ack_pending=MAX_ACK_PENDING)
        try:
            info = await js.add_consumer(stream, config)
        except APIError as exc:
            log.warning("%s: consumer %s keeps its filter %s (%s wanted): %s", self.spec.name, durable, list(had),
                        list(wanted), exc)
            return
        log.info("%s: consumer %s now filters %s (was %s)", self.spec.name, durable, list(wanted), list(had))
        self._check_filters(durable, _filters_of(info.config), wanted)

    def _check_filters(self, durable: str, got: tuple[str, ...], wanted: tuple[str, ...]) -> None:
        """Warn when the server's answer shows other filters than were asked for: a server that reports a version
        taking several filters but dropped them (a cluster mid-upgrade whose consumer leader is older; ADR-34 has
        clients check the answer). Nothing is lost: a message no handler takes is acked unread (`routed`)."""
        if got != wanted:
            log.warning("%s: consumer %s filters %s, not the %s asked for", self.spec.name, durable, list(got),
                        list(wanted))

    async def _consume(self, stream: str, subject: str, durable: str, batch_fn: BatchHandler | None) -> None:
        """Pull batches from one durable consumer and settle every message, until the connection is closed (the
        broker stopped: shutdown, or a lost lease) or the task is cancelled. A failed pull (a timeout, a status
        the server answers a pull with, a reconnection) is followed by the next one: it never ends consumption."""
        nc = self.broker.config.connection_state.connection
        watch = self._watches[durable]
        puller = Puller(nc, stream, durable, self._inbox_prefix)
        await puller.start()
        try:
            while True:
                try:
                    msgs = await puller.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
                    if self.spec.batch_linger_s > 0 and len(msgs) < FETCH_BATCH:
                        await asyncio.sleep(self.spec.batch_linger_s)
                        msgs += await puller.fetch(FETCH_BATCH - len(msgs), timeout=FETCH_WAIT_S, wait=False)
                except TimeoutError:
                    watch.progress_at = time.monotonic()  # nothing to take: as far along as it can be
                    continue
                except Exception as exc:
                    if nc.is_closed:
                        log.info("%s: stopped consuming %s: the connection is closed", self.spec.name, subject)
                        return
                    log.warning("%s: pull from %s failed, pulling again: %s: %s", self.spec.name, durable,
                                type(exc).__name__, exc)
                    await asyncio.sleep(0.5)
                    continue
                try:
                    if batch_fn is not None:
                        await self._on_batch(batch_fn, msgs)
                    else:
                        await self._process_batch(msgs)
                except Exception:
                    # Nothing a batch holds may end consumption (issue 43: one body stopped a consumer for good):
                    # what the batch path left unsettled takes the per-message path.
                    log.exception("%s: a batch of %d from %s failed; settling its messages one by one",
                                  self.spec.name, len(msgs), durable)
                    await self._settle_each(msgs)
                watch.progress_at = time.monotonic()
        finally:
            with contextlib.suppress(Exception):
                await puller.close()

    async def _settle_each(self, msgs: Sequence[Msg]) -> None:
        """Settle each message not yet settled on the per-message path (handled, or nak'd and dead-lettered at
        MAX_DELIVER). A message even that cannot settle (Postgres or NATS gone) is left to JetStream, which delivers it
        again after the ack wait, at most MAX_DELIVER times."""
        for m in msgs:
            if _settled(m):
                continue
            try:
                if self.routed(m.subject):
                    await self._process(m)
                else:
                    await m.ack()
            except Exception as exc:
                log.error("%s: could not settle the message on %s (seq %s), JetStream delivers it again: %s: %s",
                          self.spec.name, m.subject, m.metadata.sequence.stream, type(exc).__name__, exc)

    async def _process_batch(self, msgs: Sequence[Msg]) -> None:
        """Handle a pulled batch in stream order in one transaction, each message with its inbox row; then settle
        each: ack (handled, duplicate, ignored, dead-lettered) or nak with delay (failed). A message that fails or
        is poison costs only itself: it is handled in a savepoint of its own, which its failure rolls back. A
        service with `optimistic_batches` handles a batch without savepoints first; if one of its handlers fails
        (or refuses), or the batch fails as a whole, the whole transaction rolls back, memory is rebuilt, and the
        batch is handled again with a savepoint per message (and so are the next few batches). If the batch fails as
        a whole even so (the commit, or the work deferred to its end), it is bisected (`_bisect`)."""
        work = []
        for m in msgs:
            if self.routed(m.subject):
                work.append(m)
            else:
                self.counters.ignored += 1
                await m.ack()
        if not work:
            return
        # Parse and check every message first (no Postgres), so that the batch's inbox rows are claimed in one
        # statement; a service that claims events per message (sharding) writes its inbox rows one by one.
        await self._handle_batch(work, [self._prepare_or_verdict(m) for m in work])

    async def _handle_batch(self, work: Sequence[Msg], prepared: Sequence[_Prepared | _DeadLetter | None], *,
                            part: bool = False) -> None:
        """One batch (or, `part`, a part of one being bisected: always with savepoints) handled and settled."""
        savepoints = part or not self.spec.optimistic_batches or self._savepoint_batches > 0
        if self._savepoint_batches > 0 and not part:
            self._savepoint_batches -= 1
        result: _BatchResult | None = None
        async with self._handle_lock:
            for attempt_savepoints in ((True,) if savepoints else (False, True)):
                try:
                    async with self.pool.acquire() as conn, conn.transaction():
                        await self._reload_if_stale(conn)
                        result = await self._run_batch(conn, work, prepared, savepoints=attempt_savepoints)
                except Exception as exc:
                    # Rolled back as a whole: memory may be ahead of the tables (rebuilt by the next attempt).
                    self._stale = True
                    result = None
                    if not attempt_savepoints:
                        # A handler failed, or the batch's end did (the rows held for it: one that Postgres refuses
                        # fails them all). With a savepoint per message each writes its own rows and fails alone.
                        self.counters.batch_retries += 1
                        self._savepoint_batches = SAVEPOINT_BATCHES_AFTER_FAILURE
                        log.info("%s: a batch of %d failed (%s: %s); handling it again with a savepoint per message",
                                 self.spec.name, len(work), type(exc).__name__, exc)
                        continue
                    log.warning("%s: a batch of %d failed as a whole, bisecting it: %s: %s",
                                self.spec.name, len(work), type(exc).__name__, exc)
                break
        if result is None:
            await self._bisect(work, prepared)
            return
        self.counters.batches += 1
        self.job_traces.committed(result.traces)
        if result.emitted:
            self._outbox_wakeup.set()
        for m, why in result.dead:
            await self._notify_dead_letter(m.data, m.subject, m.metadata.sequence.stream, m.metadata.num_delivered,
                                           why.reason, why.message)
            await m.ack()
        for m, outcome, error in result.outcomes:
            if error is None:
                self._count(outcome)
                await m.ack()
            else:
                await self._retry_or_give_up(m, error)

    async def _bisect(self, work: Sequence[Msg], prepared: Sequence[_Prepared | _DeadLetter | None]) -> None:
        """A batch that failed as a whole although each message had its own savepoint: the failure is the batch's
        (its commit, or the work deferred to its end), caused by one or a few of its messages. Each half is handled as
        a batch of its own, a half that fails again is halved again, and the messages of a part of BISECT_PART or
        fewer take the per-message path one by one (nak with backoff, dead-lettered at MAX_DELIVER, or at once for
        data Postgres refuses). One bad message among n costs about 2·log2(n/BISECT_PART) + BISECT_PART transactions,
        and the good messages of each half are committed together; handling all n one by one cost n units of work,
        each with its own cycle (admission's), on every delivery of the bad one (issue 43)."""
        if len(work) <= BISECT_PART:
            for m in work:
                await self._process(m)
            return
        middle = len(work) // 2
        await self._handle_batch(work[:middle], prepared[:middle], part=True)
        await self._handle_batch(work[middle:], prepared[middle:], part=True)

    async def _run_batch(self, conn: asyncpg.Connection, work: Sequence[Msg],
                         prepared: Sequence[_Prepared | _DeadLetter | None], *, savepoints: bool) -> _BatchResult:
        """One attempt at a batch inside the caller's transaction. With `savepoints`, each handled message runs in a
        savepoint of its own and a failure rolls back only that message; without, the first failing handler
        raises _Optimism (the caller rolls the transaction back and tries again with savepoints)."""
        result = _BatchResult()
        batch = _BatchWork(claimed=await self._claim_inbox(conn, prepared))
        if self.spec.prefetch is not None:
            await self.spec.prefetch(conn, [
                (p.event, p.payload, p.subject) for p in prepared if isinstance(p, _Prepared)
                and (batch.claimed is None or p.inbox_id in batch.claimed)], result.scratch)
        deferred: dict[str, Callable[[Tx], Awaitable[None]]] = {}
        for m, p in zip(work, prepared, strict=True):
            if p is None or (isinstance(p, _Prepared) and batch.claimed is not None
                             and p.inbox_id not in batch.claimed):
                # ignored, or a duplicate: nothing to do, no savepoint needed
                result.outcomes.append((m, "ignored" if p is None else "duplicate", None))
                continue
            if isinstance(p, _DeadLetter):  # poison, known before any handler ran: nothing of it to roll back
                result.dead.append((m, p))
                await self._record_dead_letter(conn, m.data, m.subject, m.metadata.sequence.stream,
                                               m.metadata.num_delivered, p.reason, p.message)
                continue
            if not savepoints:
                try:
                    outcome, wrote = await self._unit(conn, m.data, m.subject, deferred, [], batch, p,
                                                      scratch=result.scratch)
                except Exception as exc:
                    raise _Optimism(f"{type(exc).__name__}: {exc}") from exc
                result.emitted = result.emitted or wrote
                result.outcomes.append((m, outcome, None))
                continue
            # A savepoint: this message's work alone. Savepoints of the same name nest and are not released (the
            # commit ends them all): one round trip to Postgres per message instead of two; a rollback goes back to
            # the newest one, the start of this message.
            await conn.execute(f"SAVEPOINT {_MESSAGE_SAVEPOINT}")
            unit_traces: list[tuple[str, str]] = []
            try:
                outcome, wrote = await self._unit(conn, m.data, m.subject, deferred, unit_traces, batch, p,
                                                  scratch=result.scratch, own_savepoint=True)
                result.emitted = result.emitted or wrote
                result.outcomes.append((m, outcome, None))
            except _DeadLetter as verdict:
                await self._roll_back_message(conn, batch, p, unit_traces)
                if verdict.handler_ran:
                    await self._reload_in(conn)
                result.dead.append((m, verdict))
                await self._record_dead_letter(conn, m.data, m.subject, m.metadata.sequence.stream,
                                               m.metadata.num_delivered, verdict.reason, verdict.message)
            except Exception as exc:
                await self._roll_back_message(conn, batch, p, unit_traces)
                await self._reload_in(conn)
                result.outcomes.append((m, "failed", exc))
        # The messages' rows, in handling order, before the rows of the work deferred to the batch's end.
        if batch.rows:
            await insert_outbox_rows(conn, self.spec.schema, batch.rows)
        result.traces = await self.job_traces.write_staged(conn, self.spec.schema, batch.traces)
        if deferred:
            tx = Tx(conn=conn, now=self.clock.now(), source=self.source, schema=self.spec.schema,
                    job_traces=self.job_traces, buffered=True, scratch=result.scratch,
                    written_traces=dict(result.traces))
            for key in sorted(deferred):
                await deferred[key](tx)
            await tx.flush()
            result.emitted = result.emitted or bool(tx.emitted)
        return result

    async def _reload_in(self, conn: asyncpg.Connection) -> None:
        """After one message's savepoint rolled back: its handler may have changed memory, which must match the
        transaction again (the batch's earlier messages included) before the next message."""
        if self.spec.reload is not None:
            await self.spec.reload(conn)

    async def _claim_inbox(self, conn: asyncpg.Connection,
                           prepared: Sequence[_Prepared | _DeadLetter | None]) -> set[str] | None:
        """Insert the inbox rows of a batch's messages in one statement; returns the ids this batch inserted (the
        others were handled before: duplicates). None where the service claims events per message (`claim`)."""
        if self.spec.claim is not None:
            return None
        rows: dict[str, str] = {}
        for p in prepared:
            if isinstance(p, _Prepared):
                rows.setdefault(p.inbox_id, p.event.type)
        if not rows:
            return set()
        ids = list(rows)
        inserted = await conn.fetch(
            f"INSERT INTO {self.spec.schema}.inbox(event_id, type) SELECT * FROM unnest($1::text[], $2::text[]) "
            "ON CONFLICT DO NOTHING RETURNING event_id", ids, [rows[i] for i in ids])
        return {r["event_id"] for r in inserted}

    async def _roll_back_message(self, conn: asyncpg.Connection, batch: _BatchWork,
                                 p: _Prepared | _DeadLetter | None, unit_traces: list[tuple[str, str]]) -> None:
        """Undo one message of a batch: its savepoint, its staged trace rows, and the inbox row the batch claimed
        for it before the savepoint (so that its redelivery, or its replay from the dead letters, is handled)."""
        await conn.execute(f"ROLLBACK TO SAVEPOINT {_MESSAGE_SAVEPOINT}")
        for job, _ in unit_traces:
            batch.traces.pop(job, None)
        if isinstance(p, _Prepared) and batch.claimed is not None:
            await conn.execute(f"DELETE FROM {self.spec.schema}.inbox WHERE event_id = $1", p.inbox_id)

    async def _retry_or_give_up(self, raw: Msg, exc: BaseException) -> None:
        if isinstance(exc, LostLeadership):
            self._deposed.set()  # another instance leads: the watcher pauses consumption now (it comes back later)
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

    async def _process(self, raw: Msg) -> None:
        """Handle one JetStream message in a unit of work of its own and settle it: ack, nak with delay, or
        dead-letter then ack."""
        meta = raw.metadata
        try:
            await self.handle(raw.data, subject=raw.subject, stream_seq=meta.sequence.stream,
                              deliveries=meta.num_delivered)
        except Exception as exc:
            await self._retry_or_give_up(raw, exc)
            return
        await raw.ack()

    async def _on_batch(self, batch_fn: BatchHandler, raws: Sequence[Msg]) -> None:
        try:
            async with self._handle_lock, self.pool.acquire() as conn:
                outcome = await batch_fn(conn, [m.data for m in raws])
        except Exception as exc:
            # The batch rolled back as a whole: settle each message on its own path instead.
            log.warning("%s: batch of %d failed, falling back to one by one: %s", self.spec.name, len(raws), exc)
            for m in raws:
                await self._process(m)
            return
        self.counters.handled += outcome.handled
        self.counters.duplicates += outcome.duplicates
        rest = list(outcome.rest)
        for m in raws:
            if m.data in rest:
                rest.remove(m.data)
                await self._process(m)  # not the batch handler's: dead letter or another handler
            else:
                await m.ack()

    async def dead_letter(self, raw: bytes, subject: str, stream_seq: int | None, deliveries: int,
                          reason: str, message: str) -> None:
        async with self.pool.acquire() as conn:
            await self._record_dead_letter(conn, raw, subject, stream_seq, deliveries, reason, message)
        await self._notify_dead_letter(raw, subject, stream_seq, deliveries, reason, message)

    async def _record_dead_letter(self, conn: asyncpg.Connection, raw: bytes, subject: str, stream_seq: int | None,
                                  deliveries: int, reason: str, message: str) -> None:
        # The body is kept whole (bytea); the text columns must take whatever the reason quotes of it.
        await conn.execute(
            f"INSERT INTO {self.spec.schema}.dead_letters(subject, stream_seq, deliveries, reason, message, body)"
            " VALUES ($1, $2, $3, $4, $5, $6)", _storable_text(subject), stream_seq, deliveries, _storable_text(reason),
            _storable_text(message, DEAD_LETTER_MESSAGE_CHARS), raw)

    async def _notify_dead_letter(self, raw: bytes, subject: str, stream_seq: int | None, deliveries: int,
                                  reason: str, message: str) -> None:
        self.counters.count_dead_letter(reason)
        log.error("%s: dead-lettering message on %s (seq %s): %s: %s", self.spec.name, subject, stream_seq,
                  reason, message)
        await self._publish_dlq_notice(subject, stream_seq, deliveries, reason, message, raw,
                                       f"dlq-{self.spec.name}-{subject}-{stream_seq}")

    async def _publish_dlq_notice(self, subject: str, stream_seq: int | None, deliveries: int, reason: str,
                                  message: str, raw: bytes, msg_id: str) -> None:
        """The dead letter on `<ns>.dlq.<service>`, its body cut to DLQ_BODY_BYTES (the table keeps it whole: an
        oversize outbox row would not fit in a NATS message either)."""
        record = {"service": self.spec.name, "subject": subject, "stream_seq": stream_seq,
                  "deliveries": deliveries, "reason": reason, "message": message,
                  "body": raw[:DLQ_BODY_BYTES].decode("utf-8", errors="replace"), "body_bytes": len(raw)}
        subject_dlq = dlq_subject(self.spec.name)
        await self.broker.publish(json.dumps(record).encode(), subject_dlq, headers={"Nats-Msg-Id": msg_id},
                                  stream=stream_for_subject(subject_dlq).name)

    # ------------------------------------------------------------------ outbox relay

    async def _relay_loop(self) -> None:
        next_prune = 0.0
        while True:
            # Cleared before the query, never after it: a unit of work that commits while the query runs sets the
            # wake-up again, so the wait below returns at once and the next query sees its rows. Cleared after the
            # query, that commit's wake-up would be lost and its rows would wait for the poll (a steady tail).
            self._outbox_wakeup.clear()
            try:
                settled = await self.relay_once()
                if asyncio.get_running_loop().time() >= next_prune:
                    next_prune = asyncio.get_running_loop().time() + PRUNE_EVERY_S
                    await self.prune_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.pool.is_closing():
                    # Its pool was closed under it (the runtime's owner shut down without stopping it): no pass can
                    # succeed again, and retrying would log an error every second for the life of the process.
                    log.warning("%s: outbox relay stops: its database pool is closed", self.spec.name)
                    return
                log.exception("%s: outbox relay failed; retrying", self.spec.name)
                settled = 0
                await asyncio.sleep(1.0)
            # A pass that found fewer rows than it may take saw every row committed before its query: the rows
            # committed since set the wake-up (cleared before the query), so the next pass waits for it instead of
            # asking again at once. Asking at once cost an empty pass (a transaction and a query) after every
            # publishing pass, that is after nearly every committed batch.
            if settled < RELAY_BATCH:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._outbox_wakeup.wait(), timeout=self.relay_poll_s)

    async def relay_once(self, limit: int = RELAY_BATCH) -> int:
        """Publish the oldest unpublished outbox rows as one pipelined batch (JetStream async publish, the acks
        awaited together), then mark them. A crash between the two republishes them on restart; JetStream drops
        the copy by Nats-Msg-Id. A row that can never be published (larger than the server's max_payload, a
        subject no stream captures, a publish JetStream refuses) is moved to `dead_letters` with its reason, so
        it never holds back the rows behind it. Returns how many rows it settled."""
        dead: list[tuple[Any, str, str]] = []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                f"SELECT seq, event_id, subject, body FROM {self.spec.schema}.outbox "
                "WHERE published_at IS NULL ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED", limit)
            if not rows:
                return 0
            sendable = []
            limit_bytes = self.max_event_bytes()
            for row in rows:
                size = len(row["body"])
                if size > limit_bytes:
                    dead.append((row, "OutboxOversize", f"{size} bytes, above the {limit_bytes}-byte limit of one "
                                                        "NATS message"))
                    continue
                try:
                    stream_for_subject(row["subject"])
                except LookupError as exc:
                    dead.append((row, "OutboxNoStream", str(exc)))
                    continue
                sendable.append(row)
            refused = await self.publish_batch(
                [(r["subject"], bytes(r["body"]), r["event_id"]) for r in sendable]) if sendable else {}
            dead += [(r, "OutboxRefused", refused[r["event_id"]]) for r in sendable if r["event_id"] in refused]
            if dead:
                await conn.executemany(
                    f"INSERT INTO {self.spec.schema}.dead_letters(subject, stream_seq, deliveries, reason, message, "
                    "body) VALUES ($1, NULL, 0, $2, $3, $4)",
                    [(r["subject"], reason, message, bytes(r["body"])) for r, reason, message in dead])
                await conn.execute(f"DELETE FROM {self.spec.schema}.outbox WHERE seq = ANY($1::bigint[])",
                                   [r["seq"] for r, _, _ in dead])
            published = [r["seq"] for r in sendable if r["event_id"] not in refused]
            await conn.execute(
                f"UPDATE {self.spec.schema}.outbox SET published_at = now() WHERE seq = ANY($1::bigint[])", published)
        self.counters.published += len(published)
        for row, reason, message in dead:  # after commit: the table row is the record, this is the notice
            self.counters.count_dead_letter(reason)
            log.error("%s: outbox row %s (%s) dead-lettered: %s: %s", self.spec.name, row["event_id"],
                      row["subject"], reason, message)
            with contextlib.suppress(Exception):
                await self._publish_dlq_notice(row["subject"], None, 0, reason, message, bytes(row["body"]),
                                               f"dlq-{self.spec.name}-outbox-{row['event_id']}")
        return len(rows)

    def max_event_bytes(self) -> int:
        """The largest body one NATS message carries here: the server's max_payload less room for the headers."""
        nc = self.broker.config.connection_state.connection
        return min(self.event_bytes_limit, nc.max_payload - HEADER_ROOM)

    async def publish_batch(self, messages: Sequence[tuple[str, bytes, str]]) -> dict[str, str]:
        """Publish (subject, body, event id) messages in order without waiting for each PubAck, then await the
        acks together (shared/jetstream.py `BatchPublisher`). Returns {event id: reason} of those JetStream refused
        (a verdict on the message, not the link); raises on a transient failure (timeout, connection), so that the
        whole batch is retried."""
        nc = self.broker.config.connection_state.connection
        if self._publisher is None or self._publisher.connection is not nc:  # first use, or a new connection
            self._publisher = BatchPublisher(nc, self._inbox_prefix)
            await self._publisher.start()
        results = await self._publisher.publish(
            [(subject, body, {"Nats-Msg-Id": event_id, "Nats-Expected-Stream": stream_for_subject(subject).name})
             for subject, body, event_id in messages], timeout=PUBLISH_TIMEOUT_S)
        refused: dict[str, str] = {}
        for (_, _, event_id), result in zip(messages, results, strict=True):
            if isinstance(result, NoStreamResponseError | ServiceUnavailableError | ServerError):
                raise result  # the server or the stream is not there or not well: a condition, retried later
            if isinstance(result, APIError):  # a 4xx answer about this message: it would fail the same way again
                refused[event_id] = f"JetStream refused the publish: {result}"
            elif result is not None:
                raise result
        return refused

    async def prune_once(self, retention_s: float | None = None) -> tuple[int, int]:
        """Delete published outbox rows and inbox rows older than the retention (`GPUQ_PLUMBING_RETENTION_S`),
        a bounded number per call. Returns (outbox rows, inbox rows) deleted. Unpublished rows are never touched."""
        keep = self.retention_s if retention_s is None else retention_s
        s = self.spec.schema
        async with self.pool.acquire() as conn:
            outbox = await conn.fetchval(
                f"WITH gone AS (DELETE FROM {s}.outbox WHERE seq IN (SELECT seq FROM {s}.outbox WHERE published_at "
                f"< now() - make_interval(secs => $1) LIMIT $2) RETURNING 1) SELECT count(*) FROM gone",
                keep, PRUNE_BATCH)
            inbox = await conn.fetchval(
                f"WITH gone AS (DELETE FROM {s}.inbox WHERE event_id IN (SELECT event_id FROM {s}.inbox WHERE "
                f"handled_at < now() - make_interval(secs => $1) LIMIT $2) RETURNING 1) SELECT count(*) FROM gone",
                keep, PRUNE_BATCH)
        return int(outbox), int(inbox)


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
