"""Dead-lettering: a message or an outbox row that must never be retried is kept whole in the service's
`<schema>.dead_letters` table (the record) and announced on `<ns>.dlq.<service>` (the notice)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import asyncpg

from shared.bus import dlq_subject, stream_for_subject

if TYPE_CHECKING:
    from faststream.nats import NatsBroker

    from shared.plumbing.spec import Counters

log = logging.getLogger("gpuq.service")

# A dead letter's reason as stored (its `message` column) is cut to this many characters.
DEAD_LETTER_MESSAGE_CHARS = 4096
DLQ_BODY_BYTES = 64 * 1024  # the body a dead letter's bus notice carries (the table row keeps all of it)


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


class DeadLetterSink:
    """Where a service's dead letters go: its table, its counters and its DLQ subject."""

    def __init__(self, name: str, schema: str, pool: asyncpg.Pool, broker: NatsBroker, counters: Counters):
        self.name = name
        self.schema = schema
        self.pool = pool
        self.broker = broker
        self.counters = counters

    async def dead_letter(self, raw: bytes, subject: str, stream_seq: int | None, deliveries: int,
                          reason: str, message: str) -> None:
        async with self.pool.acquire() as conn:
            await self.record(conn, raw, subject, stream_seq, deliveries, reason, message)
        await self.notify(raw, subject, stream_seq, deliveries, reason, message)

    async def record(self, conn: asyncpg.Connection, raw: bytes, subject: str, stream_seq: int | None,
                     deliveries: int, reason: str, message: str) -> None:
        # The body is kept whole (bytea); the text columns must take whatever the reason quotes of it.
        await conn.execute(
            f"INSERT INTO {self.schema}.dead_letters(subject, stream_seq, deliveries, reason, message, body)"
            " VALUES ($1, $2, $3, $4, $5, $6)", _storable_text(subject), stream_seq, deliveries, _storable_text(reason),
            _storable_text(message, DEAD_LETTER_MESSAGE_CHARS), raw)

    async def notify(self, raw: bytes, subject: str, stream_seq: int | None, deliveries: int,
                     reason: str, message: str) -> None:
        self.counters.count_dead_letter(reason)
        log.error("%s: dead-lettering message on %s (seq %s): %s: %s", self.name, subject, stream_seq,
                  reason, message)
        await self.publish_notice(subject, stream_seq, deliveries, reason, message, raw,
                                  f"dlq-{self.name}-{subject}-{stream_seq}")

    async def publish_notice(self, subject: str, stream_seq: int | None, deliveries: int, reason: str,
                             message: str, raw: bytes, msg_id: str) -> None:
        """The dead letter on `<ns>.dlq.<service>`, its body cut to DLQ_BODY_BYTES (the table keeps it whole: an
        oversize outbox row would not fit in a NATS message either)."""
        record = {"service": self.name, "subject": subject, "stream_seq": stream_seq,
                  "deliveries": deliveries, "reason": reason, "message": message,
                  "body": raw[:DLQ_BODY_BYTES].decode("utf-8", errors="replace"), "body_bytes": len(raw)}
        subject_dlq = dlq_subject(self.name)
        await self.broker.publish(json.dumps(record).encode(), subject_dlq, headers={"Nats-Msg-Id": msg_id},
                                  stream=stream_for_subject(subject_dlq).name)
