"""The transactional outbox's relay: rows a unit of work committed to `<schema>.outbox` are published to
JetStream afterwards (`Nats-Msg-Id` = event id, so a crash between publish and marking publishes nothing twice),
rows that can never be published are dead-lettered, and old published outbox and inbox rows are pruned."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg
from nats.js.errors import APIError, NoStreamResponseError, ServerError, ServiceUnavailableError

from shared.bus import stream_for_subject
from shared.events import MAX_EVENT_BYTES
from shared.jetstream import BatchPublisher
from shared.plumbing.deadletters import DeadLetterSink
from shared.settings import settings

if TYPE_CHECKING:
    from faststream.nats import NatsBroker

    from shared.plumbing.spec import Counters

log = logging.getLogger("gpuq.service")

# The outbox relay: rows per pipelined batch, and how long the batch's PubAcks may take all together.
RELAY_BATCH = 512
PUBLISH_TIMEOUT_S = 10.0
# How long the relay waits for a wake-up (a unit of work committed outbox rows) before it looks at the table anyway:
# a backstop for rows committed by another process or instance, not the path of this one's rows.
RELAY_POLL_S = 0.5
HEADER_ROOM = 4096  # bytes kept free below max_payload for the message's headers (Nats-Msg-Id, trace context)
# An event body's own limit (the server's max_payload, 1 MiB by default, minus HEADER_ROOM applies as well).
EVENT_BYTES_LIMIT = MAX_EVENT_BYTES
# Published outbox rows and inbox rows are kept this long, then pruned (GPUQ_PLUMBING_RETENTION_S). The inbox must
# outlive every redelivery of an event (max_deliver x ack_wait plus backoff: minutes) and the publish duplicate
# window, so the setting has a floor of one hour.
RETENTION_ENV = "GPUQ_PLUMBING_RETENTION_S"
DEFAULT_RETENTION_S = 7 * 86_400.0
MIN_RETENTION_S = 3_600.0
PRUNE_EVERY_S = 300.0
PRUNE_BATCH = 10_000


def retention_from_env(env: Mapping[str, str] = os.environ) -> float:
    """The plumbing retention in seconds from GPUQ_PLUMBING_RETENTION_S (default 7 days, at least one hour)."""
    return settings(env).plumbing_retention_s


# What the relay publishes through: (subject, body, event id) messages in; {event id: reason} of those refused out.
PublishBatch = Callable[[Sequence[tuple[str, bytes, str]]], Awaitable[dict[str, str]]]


class OutboxRelay:
    """Publishes one service's outbox. A unit of work that committed outbox rows calls `wake`, so its rows go out
    at once; `poll_s` is the backstop for rows committed by another process or instance."""

    def __init__(self, name: str, schema: str, pool: asyncpg.Pool, broker: NatsBroker, counters: Counters,
                 dead_letters: DeadLetterSink, inbox_prefix: str):
        self.name = name
        self.schema = schema
        self.pool = pool
        self.broker = broker
        self.counters = counters
        self.dead_letters = dead_letters
        self.inbox_prefix = inbox_prefix  # the publishes' replies
        self.wakeup = asyncio.Event()
        self.poll_s = RELAY_POLL_S
        self.retention_s = retention_from_env()
        self.event_bytes_limit = EVENT_BYTES_LIMIT
        self._publisher: BatchPublisher | None = None

    def wake(self) -> None:
        """Rows were committed: the loop publishes them now instead of at its next poll."""
        self.wakeup.set()

    async def run(self, relay_once: Callable[[], Awaitable[int]],
                  prune_once: Callable[[], Awaitable[tuple[int, int]]]) -> None:
        """The relay loop, passing through `relay_once` and `prune_once` (the runtime's methods of those names, the
        seams its tests replace)."""
        next_prune = 0.0
        while True:
            # Cleared before the query, never after it: a unit of work that commits while the query runs sets the
            # wake-up again, so the wait below returns at once and the next query sees its rows. Cleared after the
            # query, that commit's wake-up would be lost and its rows would wait for the poll (a steady tail).
            self.wakeup.clear()
            try:
                settled = await relay_once()
                if asyncio.get_running_loop().time() >= next_prune:
                    next_prune = asyncio.get_running_loop().time() + PRUNE_EVERY_S
                    await prune_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self.pool.is_closing():
                    # Its pool was closed under it (the runtime's owner shut down without stopping it): no pass can
                    # succeed again, and retrying would log an error every second for the life of the process.
                    log.warning("%s: outbox relay stops: its database pool is closed", self.name)
                    return
                log.exception("%s: outbox relay failed; retrying", self.name)
                settled = 0
                await asyncio.sleep(1.0)
            # A pass that found fewer rows than it may take saw every row committed before its query: the rows
            # committed since set the wake-up (cleared before the query), so the next pass waits for it instead of
            # asking again at once. Asking at once cost an empty pass (a transaction and a query) after every
            # publishing pass, that is after nearly every committed batch.
            if settled < RELAY_BATCH:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), timeout=self.poll_s)

    async def relay_once(self, publish_batch: PublishBatch, limit: int = RELAY_BATCH) -> int:
        """Publish the oldest unpublished outbox rows as one pipelined batch (JetStream async publish, the acks
        awaited together), then mark them. A crash between the two republishes them on restart; JetStream drops
        the copy by Nats-Msg-Id. A row that can never be published (larger than the server's max_payload, a
        subject no stream captures, a publish JetStream refuses) is moved to `dead_letters` with its reason, so
        it never holds back the rows behind it. Returns how many rows it settled."""
        dead: list[tuple[Any, str, str]] = []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                f"SELECT seq, event_id, subject, body FROM {self.schema}.outbox "
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
            refused = await publish_batch(
                [(r["subject"], bytes(r["body"]), r["event_id"]) for r in sendable]) if sendable else {}
            dead += [(r, "OutboxRefused", refused[r["event_id"]]) for r in sendable if r["event_id"] in refused]
            if dead:
                await conn.executemany(
                    f"INSERT INTO {self.schema}.dead_letters(subject, stream_seq, deliveries, reason, message, "
                    "body) VALUES ($1, NULL, 0, $2, $3, $4)",
                    [(r["subject"], reason, message, bytes(r["body"])) for r, reason, message in dead])
                await conn.execute(f"DELETE FROM {self.schema}.outbox WHERE seq = ANY($1::bigint[])",
                                   [r["seq"] for r, _, _ in dead])
            published = [r["seq"] for r in sendable if r["event_id"] not in refused]
            await conn.execute(
                f"UPDATE {self.schema}.outbox SET published_at = now() WHERE seq = ANY($1::bigint[])", published)
        self.counters.published += len(published)
        for row, reason, message in dead:  # after commit: the table row is the record, this is the notice
            self.counters.count_dead_letter(reason)
            log.error("%s: outbox row %s (%s) dead-lettered: %s: %s", self.name, row["event_id"],
                      row["subject"], reason, message)
            with contextlib.suppress(Exception):
                await self.dead_letters.publish_notice(row["subject"], None, 0, reason, message, bytes(row["body"]),
                                                       f"dlq-{self.name}-outbox-{row['event_id']}")
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
            self._publisher = BatchPublisher(nc, self.inbox_prefix)
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
        s = self.schema
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
