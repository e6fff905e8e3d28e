"""`gpuq budget` on a real Postgres (issue 48): each budgeted team's use in its period, the share of its budget, the
forecast, its state and what happens at 100%, from metering's read model; `-o json` says the same records. (Fails on
the code before: no such command.)"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from typer.testing import CliRunner

from cli.main import app
from services.core.metering.budget import Held, statuses
from services.metering import budgets, store
from shared.db import create_pool
from shared.interactive import Budget, BudgetPeriod, ExhaustedPolicy
from tests.service.cli.test_cli_terminal import _env

NOW = datetime(2026, 12, 11, tzinfo=UTC)


async def seed(database_url: str) -> None:
    pool = await create_pool(database_url)
    try:
        await store.migrate(pool)
        rows = [Held("team-a", 8, datetime(2026, 12, 1, tzinfo=UTC), None), Held("team-b", 1, NOW, None)]
        found = statuses({"team-a": Budget(gpu_hours=2000, on_exhausted=ExhaustedPolicy.APPROVAL),
                          "team-b": Budget(gpu_hours=100, period=BudgetPeriod.QUARTER)}, rows, NOW)
        async with pool.acquire() as conn:
            await budgets.write(conn, found, NOW)
    finally:
        await pool.close()


def test_budget_shows_use_forecast_and_policy(fresh_sync: tuple[str, str]) -> None:
    nats_url, database_url = fresh_sync
    asyncio.run(seed(database_url))
    env = _env(nats_url, database_url)
    done = CliRunner().invoke(app, ["budget"], env=env)
    assert done.exit_code == 0, done.output
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("team-")}
    assert lines["team-a"].split()[1:6] == ["2026-12", "2,000", "1,920.0", "96%", "5,952"], lines["team-a"]
    assert "warning" in lines["team-a"] and "admin approval" in lines["team-a"]
    assert lines["team-b"].split()[1:5] == ["2026-Q4", "100", "0.0", "0%"] and "preemptible only" in lines["team-b"]
    records = json.loads(CliRunner().invoke(app, ["budget", "-o", "json", "--team", "team-a"], env=env).stdout)
    assert [(r["team"], r["state"], r["used_gpu_hours"]) for r in records] == [("team-a", "warning", 1920.0)]
