"""After a restore: the bus brought in line with the restored database (docs/install.md, "Backups and restore").

A backup holds what the services had handled at its moment, T. The bus holds everything since (its streams keep
events for 30 days), but it has moved on with the lost database: the services' durable consumers acknowledged what
that database handled after T, and some of what waited for them then holds decisions the restored database never
made. Left alone, the restored platform would lose what came after T (a submission the lost database admitted), miss
what a lagging service had not handled by T though its producer had decided it (a completion the ledger had not
recorded yet), and take as done what only the lost database decided (a completion of a run the restored executor
will end again: counted twice).

`gpuq reconcile-bus --since S`, run while gpuq's services are stopped, with S at or before T:

1. Moves every gpuq durable consumer past everything now on the bus, so that nothing published before this moment
   reaches a service by itself (the consumers are made again, with their configuration, from the streams' ends).
2. Publishes again, unchanged and in the order they were published, every event since S that the restored platform
   must see: each one a restored service had published (its event id is in that service's restored outbox: a
   decision the restored state holds, which some consumer may not have handled by T), each request from outside
   (submissions, cancel requests, approvals, queue configuration changes, a job's reported FLOPs), and every audit
   record (history: what the lost database decided happened, and the audit trail keeps it). Consumers that handled
   an event before T recognise its id in their inboxes and skip it; the others handle it once.
3. Leaves out the rest: decisions only the lost database made (admitted, placed, started, ended, preempted, samples,
   status news after T). The restored services make them again from what they restored and what they are sent.

It reads each stream only up to where it ended when the command started (never its own copies), marks its copies so
that running it twice within the bus's two minutes of deduplication publishes nothing twice (later, the inboxes skip
them), and refuses to run while a service consumes. It needs the admin bus credential (NATS_URL) and the restored
database (DATABASE_URL)."""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import re
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import asyncpg
import nats.errors
import typer
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy
from rich.console import Console
from rich.markup import escape

from cli.runtime import database_url, nats_url
from shared import bus
from shared import namespace as namespaces
from shared.natsauth import SERVICE_CONSUMES, redact_url
from shared.service import retention_from_env

console = Console()
# The gpuq schemas with an inbox and an outbox.
SCHEMAS = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit", "api")
# Requests from outside gpuq (teams, the API, admins, the Kubernetes intake, jobs themselves), below the namespace:
# no service re-derives them, so all of them since --since are published again.
REQUESTS = ("job.submitted.*", "job.cancel_requested.*", "job.approved", "queue.config_changed",
            "utilization.flops_reported.*")
HISTORY = ("audit.>",)  # kept whoever decided it: the audit trail records what happened
SKIPPED_STREAMS = ("DLQ",)  # dead-letter notices: the services' dead_letters tables hold them
FETCH = 256
MSG_ID_SUFFIX = ":replay"
# How much earlier than --since the outboxes are read: their times are the database server's, the bus's are its own.
CLOCK_MARGIN = timedelta(hours=1)


class ReconcileError(ValueError):
    """A reconciliation refused (before anything changed), saying why."""


@dataclass
class Reconciled:
    consumers: list[str] = field(default_factory=list)  # the durable consumers moved to the streams' ends
    published: Counter[str] = field(default_factory=Counter)  # by kind: restored decision, request, audit record
    dropped: int = 0  # decisions only the lost database made
    duplicates: int = 0  # copies the bus already had (the same run twice within its dedup window)
    first_kept: datetime | None = None  # the oldest event a stream still holds, when it let older go after --since


Item = tuple[datetime, str, int, Msg]  # published at, stream, sequence, the message


def _durable_re() -> re.Pattern[str]:
    """gpuq's durable consumer names: `<service>[-c-<cohorts>]-<stream pattern>` (shared/service.py)."""
    services = "|".join(sorted(SERVICE_CONSUMES))
    patterns = "|".join(sorted({bus.pattern_name(p) for ps in SERVICE_CONSUMES.values() for p in ps}))
    return re.compile(rf"^({services})(-c-[A-Za-z0-9+_.-]+)?-({patterns})$")


async def gpuq_consumers(js: JetStreamContext, stream: str) -> list[ConsumerInfo]:
    """The durable consumers of gpuq's services on `stream` (not an ephemeral one, nor another program's)."""
    named = _durable_re()
    return [c for c in await js.consumers_info(stream)
            if c.config.durable_name and named.match(c.config.durable_name)]


async def _reset(js: JetStreamContext, stream: str, info: ConsumerInfo, after: int) -> None:
    """Make consumer `info` again with its configuration, delivering only what comes after sequence `after`."""
    await js.delete_consumer(stream, info.name)
    await js.add_consumer(stream, replace(info.config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                          opt_start_seq=after + 1, opt_start_time=None))


async def _messages(js: JetStreamContext, stream: str, pattern: str, since: datetime,
                    upto: int) -> AsyncIterator[Item]:
    """The stream's messages on `pattern` published since `since`, up to sequence `upto`, in order, through an
    ephemeral consumer that acknowledges nothing."""
    if upto == 0:
        return
    sub = await js.pull_subscribe(pattern, stream=stream, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since.astimezone(UTC),
        ack_policy=AckPolicy.NONE, inactive_threshold=60.0))
    try:
        while (await sub.consumer_info()).num_pending:
            try:
                msgs = await sub.fetch(FETCH, timeout=5)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                if seq > upto:  # published after the command started (its own copies among them)
                    return
                yield msg.metadata.timestamp, stream, seq, msg
    finally:
        await sub.unsubscribe()


async def _merged(sources: list[AsyncIterator[Item]]) -> AsyncIterator[Item]:
    """The sources' messages in the order they were published (the time the server stamped, then the stream and
    its sequence), holding one message of each source at a time."""
    heads: list[tuple[datetime, str, int, int, Item]] = []

    async def advance(i: int) -> None:
        item = await anext(sources[i], None)
        if item is not None:
            heapq.heappush(heads, (item[0], item[1], item[2], i, item))

    for i in range(len(sources)):
        await advance(i)
    while heads:
        *_, i, item = heapq.heappop(heads)
        yield item
        await advance(i)


def kind_of(subject: str, event_id: str | None, restored: set[str]) -> str | None:
    """Why an event is published again ("restored decision", "request", "audit record"), or None: left out."""
    tail = subject.removeprefix(f"{namespaces.current()}.")
    if event_id is not None and event_id in restored:
        return "restored decision"
    if any(bus.matches(p, tail) for p in REQUESTS):
        return "request"
    if any(bus.matches(p, tail) for p in HISTORY):
        return "audit record"
    return None


def _event_id(msg: Msg) -> str | None:
    """The CloudEvent id a message carries: its Nats-Msg-Id (gpuq publishes every event with it), else its body's."""
    header = (msg.headers or {}).get("Nats-Msg-Id")
    if header:
        return header
    try:
        body = json.loads(msg.data)
    except ValueError:
        return None
    found = body.get("id") if isinstance(body, dict) else None
    return found if isinstance(found, str) else None


async def reconcile(js: JetStreamContext, since: datetime, restored: set[str]) -> Reconciled:
    """Steps 1 to 3 of the module's docstring; `restored`: the event ids in the restored outboxes."""
    out = Reconciled()
    kept = [s for s in bus.streams() if not s.name.endswith(tuple(f"_{x}" for x in SKIPPED_STREAMS))]
    names = [s.name for s in kept]
    ends = {name: (await js.stream_info(name)).state for name in names}
    consumers = {name: await gpuq_consumers(js, name) for name in names}
    busy = sorted(c.name for cs in consumers.values() for c in cs if c.num_waiting)
    if busy:
        raise ReconcileError(f"gpuq's services are consuming ({', '.join(busy)}): stop them first (scale the "
                             "Deployments to 0), then run this, then start them on the restored database")
    for name, state in ends.items():
        for info in consumers[name]:
            await _reset(js, name, info, state.last_seq)
            out.consumers.append(info.name)
        if state.messages and state.first_seq > 1:  # the stream let older events go (age, size): maybe some since
            first = (await js.get_msg(name, state.first_seq)).time
            if first is not None and first > since:
                out.first_kept = min(out.first_kept or first, first)
    sources = [_messages(js, s.name, pattern, since, ends[s.name].last_seq) for s in kept for pattern in s.subjects]
    async for _, _, _, msg in _merged(sources):
        event_id = _event_id(msg)
        kind = kind_of(msg.subject, event_id, restored)
        if kind is None:
            out.dropped += 1
            continue
        headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"}
        original = event_id or f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"
        ack = await js.publish(msg.subject, msg.data, headers={**headers, "Nats-Msg-Id": original + MSG_ID_SUFFIX},
                               timeout=10.0)
        if ack.duplicate:
            out.duplicates += 1
        else:
            out.published[kind] += 1
    return out


async def restored_state(url: str, since: datetime) -> tuple[set[str], datetime | None]:
    """The event ids the restored outboxes hold from about `since` on, and when the restored services last handled
    an event (their inboxes' newest row: the backup's moment, while no service has run on the database since)."""
    conn = await asyncpg.connect(url)
    try:
        ids: set[str] = set()
        newest: datetime | None = None
        for schema in SCHEMAS:
            if not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL",
                                       f"{schema}.outbox", f"{schema}.inbox"):
                continue  # a service that never ran on this database
            rows = await conn.fetch(f"SELECT event_id FROM {schema}.outbox WHERE created_at >= $1",
                                    since - CLOCK_MARGIN)
            ids.update(r["event_id"] for r in rows)
            at = await conn.fetchval(f"SELECT max(handled_at) FROM {schema}.inbox")
            if at is not None and (newest is None or at > newest):
                newest = at
        return ids, newest
    finally:
        await conn.close()


def check_since(since: datetime, now: datetime, handled: datetime | None, retention_s: float) -> None:
    """Refuse a --since that would have events handled twice or missed: in the future (a typo), after the restored
    database's last handled event (what came between would be left out), or before what its inboxes remember (their
    rows go after the plumbing retention: an older event, handled before the backup, would be handled again)."""
    if since > now:
        raise ReconcileError(f"--since {since.isoformat()} is in the future (now {now.isoformat()})")
    if handled is None:
        return
    if since > handled:
        raise ReconcileError(
            f"--since {since.isoformat()} is after the restored database's last handled event ({handled.isoformat()}):"
            " what was published between them would be left out; start at the backup's moment or before")
    if since < handled - timedelta(seconds=retention_s):
        raise ReconcileError(
            f"--since {since.isoformat()} is more than GPUQ_PLUMBING_RETENTION_S ({retention_s:g} s) before the "
            f"restored database's last handled event ({handled.isoformat()}): its inboxes no longer remember what "
            "they handled that long ago, and those events would be handled twice; start at the backup's moment")


def parse_since(text: str) -> datetime:
    try:
        at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReconcileError(f"--since {text!r} is not an ISO 8601 time (e.g. 2026-12-05T08:00:00+00:00)") from None
    if at.tzinfo is None:
        raise ReconcileError(f"--since {text!r} has no time zone: give one (e.g. 2026-12-05T08:00:00Z)")
    return at


def reconcile_bus(
    since: str = typer.Option(
        ..., "--since", help="The backup's moment, with its zone, minus a margin (clocks; and how far a service may "
                             "have been behind then: minutes, more if one was down): pg_dump's start (pg_restore "
                             "--list shows 'Archive created at'), or CloudNativePG's recovery target"),
) -> None:
    """After restoring gpuq's database from a backup, with the services stopped: bring the bus in line with it. Moves
    gpuq's consumers past what is on the bus, then publishes again, in order, what the restored platform must see
    since --since: the events its services had published, the requests from outside, the audit records; what only the
    lost database decided is left out (the restored services decide it again). Needs NATS_URL with the admin bus
    credential and DATABASE_URL of the restored database."""
    now = datetime.now(UTC)
    try:
        at = parse_since(since)
        if not os.environ.get("DATABASE_URL"):
            raise ReconcileError("set DATABASE_URL to the restored database (its outboxes say what it decided)")
        restored, handled = asyncio.run(restored_state(database_url(), at))
        check_since(at, now, handled, retention_from_env())
    except ReconcileError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None

    async def run() -> Reconciled:
        url = nats_url()
        try:
            nc = await bus.connect(url, "gpuq-reconcile-bus")
        except ConnectionError as exc:
            raise ReconcileError(str(exc)) from None
        try:
            return await reconcile(nc.jetstream(), at, restored)
        except nats.errors.Error as exc:
            raise ReconcileError(f"the bus at {redact_url(url)} refused: {type(exc).__name__}: {exc} (this needs the "
                                 "admin bus credential)") from None
        finally:
            await nc.close()

    try:
        done = asyncio.run(run())
    except ReconcileError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2 if "stop them first" in str(exc) else 1) from None
    console.print(f"consumers moved to the streams' ends: {len(done.consumers)}")
    published = ", ".join(f"{n} {kind}s" for kind, n in sorted(done.published.items())) or "nothing"
    console.print(f"published again since {at.isoformat()}: {published}; left out (only the lost database decided "
                  f"them): {done.dropped}" + (f"; {done.duplicates} already published by an earlier run"
                                              if done.duplicates else ""), soft_wrap=True)
    if done.first_kept is not None:
        console.print(f"[yellow]warning:[/] the streams hold nothing before {done.first_kept.isoformat()} (their age "
                      "or size limit): events published between --since and then are gone", soft_wrap=True)
