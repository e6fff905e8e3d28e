"""Reading the dead letters every service keeps (its `<schema>.dead_letters` table, shared/service.py): what
`gpuq dead-letters` lists and GET /v1/dead-letters answers.

A team sees only the dead letters of messages published on its own subjects (`<ns>.job.submitted.<team>` and the
other team-scoped subjects, which only that team's credential may publish on); an admin sees every one. The table
rows are the record; the `<ns>.dlq.<service>` stream is only their notice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

import asyncpg

from shared.events import CATALOGUE

Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

PREVIEW_CHARS = 200  # of a dead letter's body, enough to recognise the message


@dataclass(frozen=True)
class DeadLetter:
    service: str  # the schema of the service that dead-lettered it
    id: int
    at: datetime
    subject: str
    stream_seq: int | None
    deliveries: int
    reason: str
    message: str
    body_bytes: int
    body_preview: str


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(name: str) -> str:
    return "'" + name.replace("'", "''") + "'"


def team_subjects(team: str) -> list[str]:
    """The subjects only `team` publishes on (every team-scoped event type's)."""
    return sorted(cls.scoped_subject(team) for cls in CATALOGUE if cls.scope == "team")


async def recent(conn: Conn, *, team: str | None, limit: int = 50, reason: str | None = None) -> list[DeadLetter]:
    """The newest dead letters of every service, newest first; only `team`'s subjects unless `team` is None."""
    schemas = [r["table_schema"] for r in await conn.fetch(
        "SELECT table_schema FROM information_schema.tables WHERE table_name = 'dead_letters' "
        "ORDER BY table_schema")]
    if not schemas:
        return []
    union = " UNION ALL ".join(
        f"SELECT {_literal(s)}::text AS service, id, created_at, subject, stream_seq, deliveries, reason, message, "
        f"octet_length(body) AS body_bytes, substring(body FROM 1 FOR {PREVIEW_CHARS * 4}) AS head "
        f"FROM {_ident(s)}.dead_letters" for s in schemas)
    rows = await conn.fetch(
        f"SELECT * FROM ({union}) d WHERE ($1::text[] IS NULL OR subject = ANY($1::text[])) "
        "AND ($2::text IS NULL OR reason = $2) ORDER BY created_at DESC, service, id DESC LIMIT $3",
        team_subjects(team) if team is not None else None, reason, limit)
    return [DeadLetter(service=r["service"], id=r["id"], at=r["created_at"], subject=r["subject"],
                       stream_seq=r["stream_seq"], deliveries=r["deliveries"], reason=r["reason"],
                       message=r["message"], body_bytes=r["body_bytes"],
                       body_preview=bytes(r["head"]).decode("utf-8", errors="replace")[:PREVIEW_CHARS])
            for r in rows]
