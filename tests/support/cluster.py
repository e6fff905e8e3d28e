"""The scheduler's node facts for tests of services that read its read model without running a scheduler: its
schema migrated and nodes recorded through its own write path (services/scheduler/nodes.py)."""

from __future__ import annotations

from collections.abc import Iterable

import asyncpg

from services.scheduler.nodes import MIGRATIONS, record_node
from shared.db import apply_migrations
from shared.domain import NodeSpec


async def record_nodes(pool: asyncpg.Pool, nodes: Iterable[NodeSpec], at: float = 0.0) -> None:
    await apply_migrations(pool, "scheduler", MIGRATIONS)
    async with pool.acquire() as conn:
        for node in sorted(nodes, key=lambda n: n.name):
            await record_node(conn, node, at=at)
