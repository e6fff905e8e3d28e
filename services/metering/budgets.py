"""GPU-hour budgets, metering's side (docs/admission.md, "GPU-hour budgets"): every few minutes of platform time,
each budgeted team's use in its current period is computed from the ledger's allocations (the arithmetic in
services/core/metering/budget.py) and written to the read model `metering.v1_budgets` (budgetmodel.py), which
admission and `gpuq budget` read. The budgets are those of the configuration in force (admission's read model); a
team no longer budgeted loses its row. A team crossing into `warning` or `exhausted` is logged once per period."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from services.admission import configmodel
from services.core.metering.budget import BudgetStatus, Held, period_bounds, statuses
from services.metering.budgetmodel import Conn
from shared.config import QueuesConfig
from shared.events import utcnow_from
from shared.service import ServiceRuntime

log = logging.getLogger("gpuq.metering")

BUDGET_REPORT_PERIOD_S = 300.0
BUDGET_POLL_S = 0.5


async def held_since(conn: Conn, since: datetime, now: datetime) -> list[Held]:
    """The ledger's allocations held at some time in [since, now), with their team (lost-work rows left out)."""
    rows = await conn.fetch(
        """SELECT j.team, a.milli_gpus / 1000.0 AS gpus, a.placed_at, a.ended_at
             FROM metering.allocations a JOIN metering.jobs j USING (job_id)
            WHERE a.node <> '' AND a.placed_at < $2 AND (a.ended_at IS NULL OR a.ended_at > $1)
            ORDER BY j.team, a.job_id, a.placed_at, a.node""", since, now)
    return [Held(r["team"], float(r["gpus"]), r["placed_at"], r["ended_at"]) for r in rows]


async def compute(conn: Conn, config: QueuesConfig, now: datetime) -> list[BudgetStatus]:
    if not config.budgets:
        return []
    since = min(period_bounds(b.period, now)[0] for b in config.budgets.values())
    return statuses(dict(config.budgets), await held_since(conn, since, now), now)


async def write(conn: Conn, found: list[BudgetStatus], now: datetime) -> list[tuple[str, str, str]]:
    """Replace the read model with `found`; the (team, period, state) of teams whose state changed to warning or
    exhausted (for the log)."""
    before = {r["team"]: (r["period"], r["state"]) for r in
              await conn.fetch("SELECT team, period, state FROM metering.budget_status")}
    await conn.execute("DELETE FROM metering.budget_status WHERE NOT (team = ANY($1::text[]))", [s.team for s in found])
    changed: list[tuple[str, str, str]] = []
    for s in found:
        await conn.execute(
            """INSERT INTO metering.budget_status (team, period, period_start, period_end, budget_gpu_hours,
                   used_gpu_hours, forecast_gpu_hours, warn_at, on_exhausted, state, reported_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
               ON CONFLICT (team) DO UPDATE SET period = EXCLUDED.period, period_start = EXCLUDED.period_start,
                   period_end = EXCLUDED.period_end, budget_gpu_hours = EXCLUDED.budget_gpu_hours,
                   used_gpu_hours = EXCLUDED.used_gpu_hours, forecast_gpu_hours = EXCLUDED.forecast_gpu_hours,
                   warn_at = EXCLUDED.warn_at, on_exhausted = EXCLUDED.on_exhausted, state = EXCLUDED.state,
                   reported_at = EXCLUDED.reported_at""",
            s.team, s.period, s.start, s.end, s.budget_gpu_hours, s.used_gpu_hours, s.forecast_gpu_hours, s.warn_at,
            s.on_exhausted.value, s.state.value, now)
        if s.state.value != "ok" and before.get(s.team) != (s.period, s.state.value):
            changed.append((s.team, s.period, s.state.value))
    return changed


async def report_once(conn: Conn, now: datetime) -> list[BudgetStatus]:
    """Compute and write the read model at `now` under the configuration in force (nothing before admission has
    recorded one)."""
    version = await configmodel.in_force(conn)
    if version is None:
        return []
    found = await compute(conn, version.config, now)
    async with conn.transaction():
        changed = await write(conn, found, now)
    for team, period, state in changed:
        log.warning("metering: team %s's GPU-hour budget for %s is %s", team, period,
                    "spent" if state == "exhausted" else "nearly spent")
    return found


async def report_budgets(runtime: ServiceRuntime, period_s: float = BUDGET_REPORT_PERIOD_S,
                         poll_s: float = BUDGET_POLL_S) -> None:
    """The loop: the read model at start and then every `period_s` of platform time."""
    last: float | None = None
    while True:
        now = runtime.clock.now()
        if last is None or now - last >= period_s:
            last = now
            async with runtime.pool.acquire() as conn:
                await report_once(conn, utcnow_from(now))
        await asyncio.sleep(poll_s)
