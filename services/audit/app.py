"""The audit service: the one writer of `audit.records`, an append-only table of who did what.

Every service records its actions and refusals as AuditRecorded events on `<ns>.audit.recorded.<service>` from its
outbox, in the transaction that did them (shared/audit.py). This service stores each once (by event id), with the
recorder taken from the subject: only that service's bus credential may publish there (shared/natsauth.py).
`gpuq audit` and the API's /v1/audit read the table.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from shared.events import AuditRecorded, CloudEvent
from shared.service import ServiceSpec, Tx

if TYPE_CHECKING:
    from services.stack import StackSettings

MIGRATIONS = Path(__file__).parent / "migrations"


async def on_recorded(tx: Tx, event: CloudEvent, payload: AuditRecorded) -> None:
    recorder = AuditRecorded.scope_of(tx.subject) or "unknown"
    await tx.conn.execute(
        "INSERT INTO audit.records(event_id, recorder, at, action, actor, team, job_id, detail) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (event_id) DO NOTHING",
        event.id, recorder, payload.at, payload.action, payload.actor, payload.team, payload.job_id,
        json.dumps(payload.detail, default=str))


def build_spec(settings: StackSettings | None = None) -> ServiceSpec:
    return ServiceSpec(name="audit", schema="audit", migrations=MIGRATIONS, handlers={AuditRecorded: on_recorded})


async def read_records(conn: asyncpg.Connection, *, since: datetime | None = None, until: datetime | None = None,
                       team: str | None = None, job_id: str | None = None, action: str | None = None,
                       limit: int = 1000) -> list[dict[str, Any]]:
    """Audit records, oldest first, filtered (None = any)."""
    if not await conn.fetchval("SELECT to_regclass('audit.records') IS NOT NULL"):
        return []
    rows = await conn.fetch(
        "SELECT id, recorder, at, action, actor, team, job_id, detail FROM audit.records "
        "WHERE ($1::timestamptz IS NULL OR at >= $1) AND ($2::timestamptz IS NULL OR at < $2) "
        "AND ($3::text IS NULL OR team = $3) AND ($4::text IS NULL OR job_id = $4) "
        "AND ($5::text IS NULL OR action = $5) ORDER BY at, id LIMIT $6", since, until, team, job_id, action, limit)
    return [{**dict(r), "detail": json.loads(r["detail"]) if isinstance(r["detail"], str) else r["detail"]}
            for r in rows]
