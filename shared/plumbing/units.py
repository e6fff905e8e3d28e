"""A unit of work's pieces: the transaction a handler writes in (`Tx`, its outbox rows and job traces), and the
verdicts and records the runtime passes between parsing, handling and settling a message (shared/service.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from shared.events import CloudEvent, EmittedEvent, Payload, encode_new_event, utcnow_from
from shared.tracing import outgoing_traceparent

Handler = Callable[["Tx", CloudEvent, Any], Awaitable[None]]
# A batch handler takes the bodies of one pulled batch and records them in one transaction, inbox rows
# included; it returns an object whose `handled`, `duplicates` and `rest` (bodies it did not take, for the
# per-message path) the runtime reads. For high-rate events (utilisation samples), where one commit per
# message would bound the rate by commit latency.
BatchHandler = Callable[[asyncpg.Connection, Sequence[bytes]], Awaitable[Any]]


def refused_data(exc: BaseException) -> bool:
    """Did Postgres refuse the data itself (SQLSTATE class 22, a data exception: a NUL, an invalid byte sequence, a
    number out of range; class 54, a limit exceeded: an index entry too large), or the driver find no encoding for it
    (a lone surrogate, an integer wider than its column)? The same message then fails the same way on every
    delivery: retrying it only holds up what comes after it."""
    return isinstance(exc, asyncpg.DataError | asyncpg.ProgramLimitExceededError | UnicodeEncodeError) or (
        isinstance(exc, asyncpg.InterfaceError) and isinstance(exc, ValueError))  # an argument it cannot encode


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
