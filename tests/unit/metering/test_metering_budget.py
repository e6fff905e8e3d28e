"""GPU-hour budgets' core (services/core/metering/budget.py): calendar periods, use clipped to the period, the linear
forecast, the 80% / 100% states, and what a new job meets when the budget is spent."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services.core.metering.budget import (
    BudgetState,
    Held,
    exhausted_verdict,
    forecast,
    period_bounds,
    period_label,
    statuses,
    used_gpu_hours,
)
from shared.config import parse_queues
from shared.interactive import Budget, BudgetPeriod, ExhaustedPolicy


def d(month: int, day: int, hour: int = 0) -> datetime:
    return datetime(2026, month, day, hour, tzinfo=UTC)


def test_periods_are_calendar_months_and_quarters() -> None:
    assert period_bounds(BudgetPeriod.MONTH, d(12, 6, 3)) == (d(12, 1), datetime(2027, 1, 1, tzinfo=UTC))
    assert period_bounds(BudgetPeriod.QUARTER, d(11, 30)) == (d(10, 1), datetime(2027, 1, 1, tzinfo=UTC))
    assert period_bounds(BudgetPeriod.QUARTER, d(3, 31, 23)) == (d(1, 1), d(4, 1))
    assert period_label(BudgetPeriod.QUARTER, d(5, 2)) == "2026-Q2"
    assert period_label(BudgetPeriod.MONTH, d(5, 2)) == "2026-05"


def test_use_is_clipped_to_the_period_and_to_now() -> None:
    rows = [Held("a", 8, d(11, 30, 20), d(12, 1, 2)),  # 2 of its hours in December
            Held("a", 0.5, d(12, 2), None),  # still held: up to now
            Held("b", 4, d(12, 3), d(12, 3, 1))]
    used = used_gpu_hours(rows, d(12, 1), datetime(2027, 1, 1, tzinfo=UTC), d(12, 3, 0))
    assert used == {"a": pytest.approx(16 + 12)}  # b's allocation starts at now


def test_forecast_extends_the_rate_so_far_and_states_follow_the_ratio() -> None:
    assert forecast(10.0, d(12, 1), datetime(2027, 1, 1, tzinfo=UTC), d(12, 11)) == pytest.approx(31.0)
    budgets = {"a": Budget(gpu_hours=30), "b": Budget(gpu_hours=20), "c": Budget(gpu_hours=100)}
    rows = [Held("a", 1, d(12, 1), None), Held("b", 1, d(12, 1), None), Held("c", 1, d(12, 1), None)]
    now = d(12, 2)  # 24 GPU-hours each
    by_team = {s.team: s for s in statuses(budgets, rows, now)}
    assert by_team["a"].state is BudgetState.WARNING  # 80%
    assert by_team["b"].state is BudgetState.EXHAUSTED
    assert by_team["c"].state is BudgetState.OK
    assert by_team["c"].forecast_gpu_hours == pytest.approx(24 * 31)


def test_a_spent_budget_refuses_non_preemptible_work_or_holds_everything_for_approval() -> None:
    assert exhausted_verdict(ExhaustedPolicy.PREEMPTIBLE_ONLY, True, "a", "2026-12") is None
    verdict = exhausted_verdict(ExhaustedPolicy.PREEMPTIBLE_ONLY, False, "a", "2026-12")
    assert verdict is not None and verdict[0] == "refuse" and "only preemptible" in verdict[1]
    verdict = exhausted_verdict(ExhaustedPolicy.APPROVAL, True, "a", "2026-12")
    assert verdict is not None and verdict[0] == "approval"


def test_budgets_are_validated_with_their_path() -> None:
    base = {"priority_classes": [{"name": "normal", "value": 0}], "queues": [{"name": "q"}]}
    with pytest.raises(Exception, match=r"budgets.team-a.gpu_hours"):
        parse_queues({**base, "budgets": {"team-a": {"gpu_hours": 0}}})
    with pytest.raises(Exception, match=r"budgets.team-a.period"):
        parse_queues({**base, "budgets": {"team-a": {"gpu_hours": 10, "period": "week"}}})
    with pytest.raises(Exception, match="not a valid team name"):
        parse_queues({**base, "budgets": {"Team A": {"gpu_hours": 10}}})
