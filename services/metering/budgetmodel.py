"""Metering's read model of GPU-hour budgets, version 1 (the view `metering.v1_budgets`, migrations/006_budgets.sql):
per budgeted team, its use in the current period, the forecast to the period's end and its state (ok, warning,
exhausted), as metering last computed them from its ledger (services/core/metering/budget.py).

Metering is the one owner of these facts: admission judges new work against them at 100% (docs/admission.md, "GPU-hour
budgets") and `gpuq budget` shows them, both reading here, never metering's tables or shell. Before metering has
started on this database the view does not exist and no budget is known (nothing is enforced). This module imports
nothing of metering's shell: any service may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

import asyncpg

Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

BUDGETS_VIEW = "metering.v1_budgets"


@dataclass(frozen=True)
class BudgetRow:
    team: str
    period: str
    period_start: datetime
    period_end: datetime
    budget_gpu_hours: float
    used_gpu_hours: float
    forecast_gpu_hours: float
    warn_at: float
    on_exhausted: str  # preemptible_only | approval
    state: str  # ok | warning | exhausted
    reported_at: datetime

    @property
    def used_ratio(self) -> float:
        return self.used_gpu_hours / self.budget_gpu_hours


async def published(conn: Conn) -> bool:
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", BUDGETS_VIEW))


async def budgets(conn: Conn, team: str | None = None) -> list[BudgetRow]:
    """Every budgeted team's row (one team's with `team`), by team; [] before metering has published any."""
    if not await published(conn):
        return []
    rows = await conn.fetch(f"SELECT * FROM {BUDGETS_VIEW} WHERE $1::text IS NULL OR team = $1 ORDER BY team", team)
    return [BudgetRow(**dict(r)) for r in rows]


async def exhausted(conn: Conn, team: str, now: datetime) -> BudgetRow | None:
    """The team's budget row when it is spent for the period that holds `now`, else None (a row of a period that
    has ended, when metering has not reported since, says nothing of this one)."""
    found = await budgets(conn, team)
    if not found or found[0].state != "exhausted" or not found[0].period_start <= now < found[0].period_end:
        return None
    return found[0]
