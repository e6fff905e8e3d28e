"""GPU-hour budgets, telemetry's side (docs/observability.md, "GPU-hour budgets"): every `check_s` of platform time
it reads metering's read model of the budgets (metering.v1_budgets, services/metering/budgetmodel.py) and

- exports each budgeted team's use as gauges (`gpuq_team_budget_used_ratio`, `gpuq_team_budget_gpu_hours`), which
  the alert GpuqBudgetNearlySpent watches (deploy/prometheus/rules);
- sends the team's webhooks `budget.warning` (at `warn_at`, 80% by default) and `budget.exhausted` (at 100%), once
  per team, period and state: the event id names them, so a second look, a restart or a second replica enqueues
  nothing new.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from services.core.telemetry.series import Gauges, Labels
from services.metering import budgetmodel
from services.metering.budgetmodel import BudgetRow, Conn
from services.telemetry.webhooks import store as webhooks
from shared.events import Payload, make_event, utcnow_from
from shared.service import ServiceRuntime

BUDGET_CHECK_S = 60.0
POLL_S = 0.5


class TeamBudgetWarning(Payload):
    """Webhook `budget.warning` / `budget.exhausted`: a team's GPU-hours in its period reached `warn_at` of its budget,
    or all of it (then new work is judged by `on_exhausted`: only preemptible work, or an admin's approval)."""

    aggregate, fact = "budget", "warning"
    team: str
    period: str
    budget_gpu_hours: float
    used_gpu_hours: float
    forecast_gpu_hours: float
    on_exhausted: str
    reported_at: datetime


class TeamBudgetExhausted(TeamBudgetWarning):
    aggregate, fact = "budget", "exhausted"


def gauges(rows: list[BudgetRow]) -> Gauges:
    ratio: dict[Labels, float] = {}
    hours: dict[Labels, float] = {}
    for r in rows:
        ratio[(("period", r.period), ("team", r.team))] = r.used_ratio
        for kind, value in (("budget", r.budget_gpu_hours), ("forecast", r.forecast_gpu_hours),
                            ("used", r.used_gpu_hours)):
            hours[(("kind", kind), ("period", r.period), ("team", r.team))] = value
    return {"gpuq_team_budget_used_ratio": ratio, "gpuq_team_budget_gpu_hours": hours}


class BudgetWatch:
    def __init__(self, check_s: float = BUDGET_CHECK_S):
        self.check_s = check_s
        self.gauges: Gauges = {}

    async def once(self, conn: Conn, now: float) -> list[str]:
        """Refresh the gauges and enqueue the webhooks due; the ids of the notifications enqueued (new or not)."""
        rows = await budgetmodel.budgets(conn)
        self.gauges = gauges(rows)
        due = []
        for r in rows:
            if r.state not in ("warning", "exhausted"):
                continue
            cls = TeamBudgetExhausted if r.state == "exhausted" else TeamBudgetWarning
            payload = cls(team=r.team, period=r.period, budget_gpu_hours=r.budget_gpu_hours,
                          used_gpu_hours=r.used_gpu_hours, forecast_gpu_hours=r.forecast_gpu_hours,
                          on_exhausted=r.on_exhausted, reported_at=r.reported_at)
            event_id = f"budget-{r.team}-{r.period}-{r.state}"
            due.append((make_event(payload, source="gpuq/telemetry", time=utcnow_from(now), subject=r.team,
                                   event_id=event_id), r.team, now))
        if due:
            await webhooks.enqueue_many(conn, due)
        return [e.id for e, _, _ in due]

    async def run(self, runtime: ServiceRuntime) -> None:
        last: float | None = None
        while True:
            now = runtime.clock.now()
            if last is None or now - last >= self.check_s:
                last = now
                async with runtime.pool.acquire() as conn:
                    await self.once(conn, now)
            await asyncio.sleep(POLL_S)
