"""The audit trail's retention: monthly partitions made ahead of their records, and months past the legal window
dropped whole (GPUQ_AUDIT_RETENTION_DAYS, shared.retention.AUDIT). The SQL functions are migration 002's; rows are
never updated or deleted, so the append-only triggers hold for every record still in the trail."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

# How far ahead partitions are made: this month's and the next one's exist before their first record.
AHEAD = (timedelta(0), timedelta(days=32))


@dataclass(frozen=True)
class AuditRetention:
    created: list[str]  # partitions made for this month and the next
    dropped: list[str]  # partitions whose every record was past the window


async def ensure_partitions(conn: asyncpg.Connection, now: datetime) -> list[str]:
    """This month's and the next month's partitions (UTC); returns those it created."""
    created = [await conn.fetchval("SELECT audit.ensure_partition($1)", now + ahead) for ahead in AHEAD]
    return [name for name in created if name]


async def drop_expired(conn: asyncpg.Connection, now: datetime, days: int) -> list[str]:
    """Drop the partitions whose records all lie more than `days` before `now`; returns their names, oldest first.
    The database refuses a cutoff within its own 30-day floor."""
    rows = await conn.fetch("SELECT name FROM audit.drop_partitions_before($1) AS name", now - timedelta(days=days))
    return [r["name"] for r in rows]


async def run_once(conn: asyncpg.Connection, now: datetime, days: int | None) -> AuditRetention:
    """One retention pass (`days` None: keep everything, only make partitions ahead)."""
    async with conn.transaction():
        created = await ensure_partitions(conn, now)
    if days is None:
        return AuditRetention(created, [])
    async with conn.transaction():
        return AuditRetention(created, await drop_expired(conn, now, days))
