"""Telemetry service tests run on a real Postgres: a database of their own on the server the suite
resolved (`database_url`), with the `telemetry` schema dropped and migrated afresh for every test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest_asyncio

from services.scheduler.nodes import MIGRATIONS as SCHEDULER_MIGRATIONS
from services.telemetry.app import MIGRATIONS
from shared.db import apply_migrations, create_pool
from shared.service import PLUMBING_SQL


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def telemetry_db_url(make_database: Callable[[str], Awaitable[str]]) -> str:
    return await make_database("telemetry")


@pytest_asyncio.fixture(loop_scope="session")
async def pool(telemetry_db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(telemetry_db_url, min_size=1, max_size=4)
    async with p.acquire() as conn:
        await conn.execute("DROP SCHEMA IF EXISTS telemetry CASCADE")
        await conn.execute(PLUMBING_SQL.format(s="telemetry"))
        await conn.execute("DROP SCHEMA IF EXISTS scheduler CASCADE")
    await apply_migrations(p, "telemetry", MIGRATIONS)
    # The nodes' owner: a restarted telemetry reads them from the scheduler's read model.
    await apply_migrations(p, "scheduler", SCHEDULER_MIGRATIONS)
    try:
        yield p
    finally:
        await p.close()
