"""The audit records as their readers see them (`gpuq audit`, the API's /v1/audit): the read side of `audit.records`,
which the audit service (services/audit/app.py) writes. No part of that shell: a reader imports nothing of the
service's runtime, nor of what the service's app imports to start.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg


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
