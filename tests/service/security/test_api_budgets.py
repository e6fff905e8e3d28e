"""GET /v1/budgets (issue 48): a team's token sees its own team's GPU-hour budget only, an admin's every team's,
from metering's read model. (Fails on the code before: no such route.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import httpx
import pytest_asyncio

from services.core.metering.budget import Held, statuses
from services.metering import budgets, store
from shared.db import create_pool
from shared.interactive import Budget
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER, QUEUES

NOW = datetime(2026, 12, 11, tzinfo=UTC)


@pytest_asyncio.fixture
async def api(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("api_budgets"), QUEUES, CLUSTER, ("api",)) as platform:
        yield platform


async def test_a_team_sees_its_own_budget_and_an_admin_every_one(api: ApiPlatform) -> None:
    pool = await create_pool(api.database_url)
    try:
        await store.migrate(pool)
        rows = [Held("team-a", 8, datetime(2026, 12, 1, tzinfo=UTC), None), Held("team-b", 1, NOW, None)]
        found = statuses({"team-a": Budget(gpu_hours=2000), "team-b": Budget(gpu_hours=100)}, rows, NOW)
        async with pool.acquire() as conn:
            await budgets.write(conn, found, NOW)
    finally:
        await pool.close()
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        mine = (await c.get("/v1/budgets", headers=auth(api.tokens["a"]))).json()
        every = (await c.get("/v1/budgets", headers=auth(api.tokens["admin"]))).json()
        assert (await c.get("/v1/budgets")).status_code == 401
    assert [(r["team"], r["state"], round(r["used_ratio"], 2)) for r in mine] == [("team-a", "warning", 0.96)]
    assert [r["team"] for r in every] == ["team-a", "team-b"]
