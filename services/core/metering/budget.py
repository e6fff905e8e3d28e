"""GPU-hour budgets (issue 48, item 6): a team's period, its use so far, a forecast to the period's end and its state.

Pure: the shell passes the ledger's allocation rows and `now`. A budget period is a calendar month or quarter in UTC.
Use is allocated GPU-hours (what the team held, busy or not, as the ledger charges it) of allocations overlapping the
period, clipped to it; an allocation still held counts up to `now`. The forecast extends the period's average rate so
far to its end (linear, as a spend forecast in a cloud bill), plus nothing for work not yet started.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from shared.interactive import Budget, BudgetPeriod, ExhaustedPolicy


class BudgetState(StrEnum):
    OK = "ok"
    WARNING = "warning"  # at or past warn_at
    EXHAUSTED = "exhausted"  # at or past 100%


def period_bounds(period: BudgetPeriod, at: datetime) -> tuple[datetime, datetime]:
    """The [start, end) of the calendar month or quarter (UTC) that holds `at`."""
    at = at.astimezone(UTC)
    first_month = at.month if period is BudgetPeriod.MONTH else 3 * ((at.month - 1) // 3) + 1
    start = datetime(at.year, first_month, 1, tzinfo=UTC)
    months = 1 if period is BudgetPeriod.MONTH else 3
    year, month = divmod(first_month - 1 + months, 12)
    return start, datetime(at.year + year, month + 1, 1, tzinfo=UTC)


def period_label(period: BudgetPeriod, at: datetime) -> str:
    """`2026-12` for a month, `2026-Q4` for a quarter."""
    start, _ = period_bounds(period, at)
    if period is BudgetPeriod.MONTH:
        return f"{start.year}-{start.month:02d}"
    return f"{start.year}-Q{(start.month + 2) // 3}"


@dataclass(frozen=True)
class Held:
    """One allocation of the ledger: `gpus` (fractions for MIG slices) held from `start` to `end` (None = still)."""

    team: str
    gpus: float
    start: datetime
    end: datetime | None


def used_gpu_hours(rows: Iterable[Held], start: datetime, end: datetime, now: datetime) -> dict[str, float]:
    """Per team, GPU-hours held within [start, min(end, now)), by team name."""
    stop = min(end, now)
    out: dict[str, float] = {}
    for row in rows:
        a = max(row.start, start)
        b = min(row.end if row.end is not None else now, stop)
        if b > a and row.gpus > 0:
            out[row.team] = out.get(row.team, 0.0) + row.gpus * (b - a).total_seconds() / 3600.0
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class BudgetStatus:
    team: str
    period: str  # period_label
    start: datetime
    end: datetime
    budget_gpu_hours: float
    used_gpu_hours: float
    forecast_gpu_hours: float
    warn_at: float
    on_exhausted: ExhaustedPolicy

    @property
    def used_ratio(self) -> float:
        return self.used_gpu_hours / self.budget_gpu_hours

    @property
    def state(self) -> BudgetState:
        if self.used_ratio >= 1.0:
            return BudgetState.EXHAUSTED
        return BudgetState.WARNING if self.used_ratio >= self.warn_at else BudgetState.OK


def forecast(used: float, start: datetime, end: datetime, now: datetime) -> float:
    """The period's use at its end if the rate so far holds (the use itself before the period has begun)."""
    elapsed = (min(now, end) - start).total_seconds()
    if elapsed <= 0:
        return used
    return used * (end - start).total_seconds() / elapsed


def statuses(budgets: dict[str, Budget], rows: list[Held], now: datetime) -> list[BudgetStatus]:
    """Every configured budget's status at `now`, by team."""
    out: list[BudgetStatus] = []
    for team, budget in sorted(budgets.items()):
        start, end = period_bounds(budget.period, now)
        used = used_gpu_hours((r for r in rows if r.team == team), start, end, now).get(team, 0.0)
        out.append(BudgetStatus(team=team, period=period_label(budget.period, now), start=start, end=end,
                                budget_gpu_hours=budget.gpu_hours, used_gpu_hours=used,
                                forecast_gpu_hours=forecast(used, start, end, now), warn_at=budget.warn_at,
                                on_exhausted=budget.on_exhausted))
    return out


def exhausted_verdict(policy: ExhaustedPolicy, preemptible: bool, team: str, period: str) -> tuple[str, str] | None:
    """What a new job of a team whose budget is spent meets: ("refuse", message) for non-preemptible work under
    `preemptible_only`, ("approval", message) for any job under `approval`, None when it may go on."""
    if policy is ExhaustedPolicy.APPROVAL:
        return "approval", (f"team {team}'s GPU-hour budget for {period} is spent: every new job waits for an admin's "
                            "approval (gpuq approve)")
    if not preemptible:
        return "refuse", (f"team {team}'s GPU-hour budget for {period} is spent: only preemptible work is accepted "
                          "until the next period (submit it preemptible, or ask an admin to raise the budget)")
    return None
