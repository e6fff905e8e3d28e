"""After a restore: the requests the backup did not hold, published again (docs/install.md, "Backups and restore").

A backup holds what the services had handled at its moment. The bus holds everything since (its streams keep events
for 30 days), but the services' durable consumers acknowledged it when the lost database handled it, so it does not
come again. Of what happened since, the restored platform re-derives the decisions itself: a job it restored as
waiting is admitted and placed again, a run it restored as running ends when it ends (the executor). What it cannot
re-derive are the requests that came from outside: submissions, cancel requests, approvals, queue configuration
changes. `gpuq replay-requests --since T` publishes again every request published on the bus since T, in the order
they were published, unchanged: the same body (the same CloudEvent id) on the same subject (the team a submission's
subject names is the team it is judged for, as the first time). A request the restored database had handled is in its
services' inboxes, which recognise the id and skip it; every other one is handled once, as if it were delivered now.

It reads each stream up to where it ended when the command started, so it never reads back what it publishes, and it
marks each copy with a message id of its own, so that running it twice within the bus's two minutes of deduplication
publishes nothing twice (later, the inboxes skip the copies). It needs the admin bus credential (NATS_URL): it
publishes on every team's subjects."""

from __future__ import annotations

import asyncio
import heapq
import os
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
import nats
import nats.errors
import typer
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from rich.console import Console
from rich.markup import escape

from cli.runtime import nats_url
from shared import bus
from shared.events import JobApproved, JobCancelRequested, JobSubmitted, Payload, QueueConfigChanged
from shared.natsauth import redact_url
from shared.service import retention_from_env

console = Console()
# The requests from outside gpuq, which no service can re-derive: everything else on the bus is a service's decision
# (admitted, placed, started, ended, preempted, ...), which the restored services make again from what they restored.
REQUESTS: tuple[type[Payload], ...] = (JobSubmitted, JobCancelRequested, JobApproved, QueueConfigChanged)
# The gpuq schemas whose inboxes tell when the restored database last handled an event (the backup's moment).
SCHEMAS = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit")
FETCH = 256
MSG_ID_SUFFIX = ":replay"


class ReplayError(ValueError):
    """A replay refused before anything was published, saying why."""


@dataclass
class Replayed:
    found: Counter[str] = field(default_factory=Counter)  # requests read, by event (JobSubmitted, ...)
    published: int = 0
    duplicates: int = 0  # copies the bus already had (the same replay run twice within its dedup window)
    first_kept: datetime | None = None  # the oldest event a stream still holds, when it let older go after `since`


Item = tuple[datetime, str, int, str, Msg]  # published at, stream, sequence, event name, the message


async def _requests(js: JetStreamContext, payload: type[Payload], stream: str, since: datetime,
                    upto: int) -> AsyncIterator[Item]:
    """The messages on `subject` published since `since`, up to stream sequence `upto`, in order, through an
    ephemeral consumer that acknowledges nothing (no service's position moves)."""
    if upto == 0:
        return
    sub = await js.pull_subscribe(payload.subscription(), stream=stream, config=ConsumerConfig(
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
                yield msg.metadata.timestamp, stream, seq, payload.__name__, msg
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


async def replay(js: JetStreamContext, since: datetime, *, dry_run: bool = False) -> Replayed:
    """Publish again every request (REQUESTS) published since `since` (see the module's docstring)."""
    out = Replayed()
    sources = []
    for payload in REQUESTS:
        stream = bus.stream_for_subject(payload.subject()).name
        state = (await js.stream_info(stream)).state
        if state.messages and state.first_seq > 1:  # the stream let older events go (age, size): maybe some since
            first = (await js.get_msg(stream, state.first_seq)).time
            if first is not None and first > since:
                out.first_kept = min(out.first_kept or first, first)
        sources.append(_requests(js, payload, stream, since, state.last_seq))
    async for _, _, _, name, msg in _merged(sources):
        out.found[name] += 1
        if dry_run:
            continue
        headers = {k: v for k, v in (msg.headers or {}).items() if k != "Nats-Msg-Id"}
        original = (msg.headers or {}).get("Nats-Msg-Id") or f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"
        ack = await js.publish(msg.subject, msg.data, headers={**headers, "Nats-Msg-Id": original + MSG_ID_SUFFIX},
                               timeout=10.0)
        out.published += 0 if ack.duplicate else 1
        out.duplicates += 1 if ack.duplicate else 0
    return out


async def last_handled(database_url: str) -> datetime | None:
    """When the database's services last handled an event (their inboxes' newest row): a restored database's backup
    moment, as long as no service has run on it since."""
    conn = await asyncpg.connect(database_url)
    try:
        newest: datetime | None = None
        for schema in SCHEMAS:
            try:
                at = await conn.fetchval(f"SELECT max(handled_at) FROM {schema}.inbox")
            except asyncpg.UndefinedTableError:
                continue
            newest = at if newest is None or (at is not None and at > newest) else newest
        return newest
    finally:
        await conn.close()


def check_since(since: datetime, now: datetime, handled: datetime | None, retention_s: float) -> None:
    """Refuse a `since` that would publish what must not be published again: in the future (a typo), or before the
    restored inboxes' memory (their rows are pruned after the plumbing retention, so a request older than that, handled
    before the backup, would be handled again)."""
    if since > now:
        raise ReplayError(f"--since {since.isoformat()} is in the future (now {now.isoformat()})")
    if handled is not None and since < handled - timedelta(seconds=retention_s):
        raise ReplayError(
            f"--since {since.isoformat()} is more than GPUQ_PLUMBING_RETENTION_S ({retention_s:g} s) before the "
            f"restored database's last handled event ({handled.isoformat()}): its inboxes no longer remember what "
            "they handled that long ago, and those requests would be handled twice; start at the backup's moment")


def parse_since(text: str) -> datetime:
    try:
        at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReplayError(f"--since {text!r} is not an ISO 8601 time (e.g. 2026-12-05T08:00:00+00:00)") from None
    if at.tzinfo is None:
        raise ReplayError(f"--since {text!r} has no time zone: give one (e.g. 2026-12-05T08:00:00Z)")
    return at


def replay_requests(
    since: str = typer.Option(
        ..., "--since", help="The backup's moment, with its zone, minus a margin for clocks (minutes are fine: what "
                             "the backup holds is recognised and skipped): pg_dump's start (pg_restore --list shows "
                             "'Archive created at'), or CloudNativePG's recovery target"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be published; publish nothing"),
) -> None:
    """After restoring gpuq's database from a backup: publish again the requests (submissions, cancel requests,
    approvals, queue configuration changes) published on the bus since the backup's moment, so that the restored
    platform handles each once (the ones the backup holds are recognised and skipped). Run it before or after starting
    the services on the restored database. Needs NATS_URL with the admin bus credential; with DATABASE_URL (the
    restored database), refuses a --since its services' inboxes do not reach back to."""
    now = datetime.now(UTC)
    try:
        at = parse_since(since)
        handled = asyncio.run(last_handled(os.environ["DATABASE_URL"])) if os.environ.get("DATABASE_URL") else None
        check_since(at, now, handled, retention_from_env())
    except ReplayError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None

    async def run() -> Replayed:
        url = nats_url()
        try:
            nc = await bus.connect(url, "gpuq-replay-requests")
        except ConnectionError as exc:
            raise ReplayError(str(exc)) from None
        try:
            return await replay(nc.jetstream(), at, dry_run=dry_run)
        except nats.errors.Error as exc:
            raise ReplayError(f"the bus at {redact_url(url)} refused the replay: {type(exc).__name__}: {exc} (it "
                              "needs the admin bus credential)") from None
        finally:
            await nc.close()

    try:
        done = asyncio.run(run())
    except ReplayError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(1) from None
    found = ", ".join(f"{n} {kind}" for kind, n in sorted(done.found.items())) or "none"
    console.print(f"requests published since {at.isoformat()}: {found}", soft_wrap=True)
    if done.first_kept is not None:
        console.print(f"[yellow]warning:[/] the streams hold nothing before {done.first_kept.isoformat()} (their age "
                      "or size limit): requests published between --since and then are gone and cannot be replayed",
                      soft_wrap=True)
    if dry_run:
        console.print("dry run: nothing published")
    else:
        console.print(f"republished {done.published}" + (f" ({done.duplicates} already republished, within the bus's "
                                                         "deduplication window)" if done.duplicates else ""))
