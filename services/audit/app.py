"""The audit service: the one writer of `audit.records`, an append-only table of who did what.

Every service records its actions and refusals as AuditRecorded events on `<ns>.audit.recorded.<service>` from its
outbox, in the transaction that did them (shared/audit.py). This service stores each once (by event id), with the
recorder taken from the subject: only that service's bus credential may publish there (shared/natsauth.py).
`gpuq audit` and the API's /v1/audit read the table (services/audit/records.py, no part of this shell). The table
is partitioned by month (migration 002); its retention loop drops the months past GPUQ_AUDIT_RETENTION_DAYS whole
(services/audit/retention.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from services.audit import retention
from shared.events import AuditRecorded, CloudEvent, utcnow_from
from shared.retention import AUDIT, periodically
from shared.service import ServiceRuntime, ServiceSpec, Tx

if TYPE_CHECKING:
    from services.stack import StackSettings

MIGRATIONS = Path(__file__).parent / "migrations"
log = logging.getLogger("gpuq.audit")

# (event_id, at) is a record's key: the table is partitioned by month of `at`, and a redelivered record carries both.
_INSERT = ("INSERT INTO audit.records(event_id, recorder, at, action, actor, team, job_id, detail) "
           "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (event_id, at) DO NOTHING")


def month_of(at: datetime) -> tuple[int, int]:
    """The (year, month) of `at` in UTC, the partitions' months (a naive time is taken as UTC, as Postgres does)."""
    utc = at.astimezone(UTC) if at.tzinfo is not None else at
    return utc.year, utc.month


class AuditWriter:
    """Stores AuditRecorded events in the partitioned audit.records.

    A record whose month has no partition yet (its time far from now: a late or skewed clock) would fail; the
    retention loop makes this month's and the next in advance, and the writer makes sure of each month once, before
    its first record, then remembers it. After a failed unit of work `forget` (the spec's reload) clears what it
    remembers: a partition made in that unit rolled back with it."""

    def __init__(self) -> None:
        self._months: set[tuple[int, int]] = set()

    async def on_recorded(self, tx: Tx, event: CloudEvent, payload: AuditRecorded) -> None:
        recorder = AuditRecorded.scope_of(tx.subject) or "unknown"
        month = month_of(payload.at)
        if month not in self._months:
            await tx.conn.execute("SELECT audit.ensure_partition($1)", payload.at)
            self._months.add(month)
        await tx.conn.execute(_INSERT, event.id, recorder, payload.at, payload.action, payload.actor, payload.team,
                              payload.job_id, json.dumps(payload.detail, default=str))

    async def forget(self, conn: asyncpg.Connection) -> None:
        del conn
        self._months.clear()


def audit_retention(days: int | None) -> Callable[[ServiceRuntime], Coroutine[Any, Any, None]]:
    """The loop that makes this month's and the next month's partitions and, with a window (`days`,
    GPUQ_AUDIT_RETENTION_DAYS), drops the months past it, hourly."""
    async def loop(runtime: ServiceRuntime) -> None:
        async def once(now: float) -> None:
            async with runtime.pool.acquire() as conn:
                done = await retention.run_once(conn, utcnow_from(now), days)
            if done.created or done.dropped:
                log.info("audit: partitions made %s, dropped past %s days %s", done.created, days, done.dropped)

        await periodically(runtime, once)

    return loop


def build_spec(settings: StackSettings | None = None) -> ServiceSpec:
    days = AUDIT.days(os.environ)  # refused here, at start, when below its floor
    writer = AuditWriter()
    return ServiceSpec(name="audit", schema="audit", migrations=MIGRATIONS,
                       handlers={AuditRecorded: writer.on_recorded}, reload=writer.forget,
                       background=(audit_retention(days),))
