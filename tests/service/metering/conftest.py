"""Metering service tests run on a real Postgres: a dedicated database on the server the suite resolved
(`database_url`), with the `metering` schema dropped and migrated afresh for every test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest_asyncio

from services.metering import store
from services.scheduler.nodes import MIGRATIONS as SCHEDULER_MIGRATIONS
from shared.db import apply_migrations, create_pool
from shared.service import PLUMBING_SQL


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def metering_db_url(make_database: Callable[[str], Awaitable[str]]) -> str:
    return await make_database("metering")


@pytest_asyncio.fixture(loop_scope="session")
async def pool(metering_db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(metering_db_url, min_size=1, max_size=4)
    async with p.acquire() as conn:
        await conn.execute(f"DROP SCHEMA IF EXISTS {store.SCHEMA} CASCADE")
        await conn.execute(PLUMBING_SQL.format(s=store.SCHEMA))
        await conn.execute("DROP SCHEMA IF EXISTS scheduler CASCADE")
    await store.migrate(p)
    # The nodes' owner: reports read GPU models from the scheduler's read model.
    await apply_migrations(p, "scheduler", SCHEDULER_MIGRATIONS)
    try:
        yield p
    finally:
        await p.close()
