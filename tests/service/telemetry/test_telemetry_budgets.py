"""GPU-hour budgets, telemetry's side, on real Postgres (issue 48): from metering's read model it exports each team's
use as gauges (what GpuqBudgetNearlySpent watches) and sends the team's `budget.warning` / `budget.exhausted` webhooks
once per team, period and state. (Fails on the code before: no such gauges or webhooks.)"""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg

from services.core.metering.budget import Held, statuses
from services.metering import budgets, store
from services.telemetry.app import TelemetryService
from services.telemetry.webhooks import store as webhooks
from shared.clock import ManualClock
from shared.db import create_pool
from shared.interactive import Budget
from shared.service import ServiceRuntime

NOW = datetime(2026, 12, 11, tzinfo=UTC)


async def test_budgets_become_gauges_and_webhooks_once(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    await store.migrate(pool)
    service = TelemetryService(metrics_port=None, webhook_worker=False)
    rt = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=ManualClock(NOW.timestamp()),
                        database_url=database_url)
    await rt.start()
    conn = await asyncpg.connect(database_url)
    try:
        for team, events in (("team-a", ["budget.warning", "budget.exhausted"]), ("team-b", ["*"])):
            await webhooks.add_subscription(conn, f"https://hooks.example.com/{team}", team, events)
        rows = [Held("team-a", 8, datetime(2026, 12, 1, tzinfo=UTC), None),  # 10 days x 8 GPUs = 1920 of 2000
                Held("team-b", 1, datetime(2026, 12, 1, tzinfo=UTC), None),  # 240 of 100: spent
                Held("team-c", 1, datetime(2026, 12, 1, tzinfo=UTC), None)]  # 240 of 10000
        found = statuses({"team-a": Budget(gpu_hours=2000), "team-b": Budget(gpu_hours=100),
                          "team-c": Budget(gpu_hours=10_000)}, rows, NOW)
        await budgets.write(conn, found, NOW)

        await service.budgets.once(conn, NOW.timestamp())
        await service.budgets.once(conn, NOW.timestamp() + 60)  # a second look sends nothing new
        metrics = service.metrics.render().decode()
        assert 'gpuq_team_budget_used_ratio{period="2026-12",team="team-a"} 0.96' in metrics
        assert 'gpuq_team_budget_gpu_hours{kind="forecast",period="2026-12",team="team-c"} 744.0' in metrics
        sent = await conn.fetch("SELECT s.team, d.event_type FROM telemetry.webhook_deliveries d "
                                "JOIN telemetry.webhook_subscriptions s ON s.id = d.subscription_id ORDER BY s.team")
        assert [(r["team"], r["event_type"]) for r in sent] == [("team-a", "io.gpuq.budget.warning.v1"),
                                                                ("team-b", "io.gpuq.budget.exhausted.v1")]
    finally:
        await conn.close()
        await rt.stop()
        await pool.close()
