"""Recording node facts in the scheduler's table: the one write path of `scheduler.nodes`, which the read model
(readmodel.py, `scheduler.v1_nodes`) exposes to every other service."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from shared.domain import NodeSpec

MIGRATIONS = Path(__file__).parent / "migrations"


async def record_node(conn: asyncpg.Connection, node: NodeSpec, *, at: float, removed: bool = False,
                      reason: str | None = None, message: str = "") -> None:
    """Record what an executor announced of `node` (an inventory announces no reason: it clears the last one). A
    removed node keeps its row, marked `removed`, so that history (metering's charges) keeps its GPU model."""
    await conn.execute(
        "INSERT INTO scheduler.nodes(name, spec, removed, updated_at, reason, message) "
        "VALUES ($1, $2, $3, $4, $5, $6) "
        "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, removed = excluded.removed, "
        "updated_at = excluded.updated_at, reason = excluded.reason, message = excluded.message",
        node.name, node.model_dump_json(), removed, at, reason, message or None)
