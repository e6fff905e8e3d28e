"""The calibrated ETA range (issue 49 item 5, `EtaModel.range_method` "calibrated"): one replay a refresh (the
median), the p10-p90 range from the split-conformal quantiles of the start errors the calibration record saw
(log(actual wait / shown wait), per queue and stratum), and a wide stated range (COLD_WIDEN) before the record
holds enough."""

from __future__ import annotations

import math
from typing import Any

import pytest

import services.core.eta.eta as eta_core
from services.core.eta import (
    COLD_WIDEN,
    RANGE_METHODS,
    EtaCalibration,
    EtaModel,
    EtaRange,
    RunningView,
    conformal_bounds,
    estimate_ranges,
)
from shared.settings import SettingsError, settings

from .test_eta_budget import _deep_queue


def _recorded(errors: list[float], queue: str = "q", window: int = 100, min_samples: int = 10) -> EtaCalibration:
    """A record of first ETAs (given at submission) of 1,000 s waits whose actual waits were 1,000·e^error."""
    cal = EtaCalibration(window=window, min_samples=min_samples)
    for i, error in enumerate(errors):
        given = 10_000.0 * i
        cal.record(queue, given, EtaRange(given + 1000.0, given + 500.0, given + 2000.0),
                   given + 1000.0 * math.exp(error), submitted_at=given)
    return cal


def test_conformal_bounds_are_the_order_statistics_of_a_synthetic_error_list() -> None:
    """99 errors 1..99 (shuffled): the floor(100 · 0.1) = 10th smallest and the ceil(100 · 0.9) = 90th smallest; too
    few for the upper one (n = 8: ceil(9 · 0.9) = 9 > 8): None."""
    errors = [float((7 * k) % 99 + 1) for k in range(99)]
    assert sorted(errors) == [float(k) for k in range(1, 100)]
    assert conformal_bounds(errors, 0.1, 0.9) == (10.0, 90.0)
    assert conformal_bounds(errors[:8], 0.1, 0.9) is None
    assert conformal_bounds([], 0.1, 0.9) is None


def test_the_calibrated_range_scales_the_wait_by_the_records_error_quantiles() -> None:
    """19 errors -0.9..0.9 (log wait): p10 = the 2nd smallest (-0.8), p90 the 18th (0.8). A new job planned 2,000 s
    out gets [2000·e^-0.8, 2000·e^0.8], its start as planned. Swapping the quantiles, or ignoring the record (the
    cold start's [w/4, 4w]), gives other bounds."""
    errors = [round(0.1 * k, 1) for k in range(-9, 10)]
    cal = _recorded(errors)
    now = 50_000_000.0
    eta = cal.calibrated_range("q", now, now + 2000.0, submitted_at=now)
    assert eta.start == now + 2000.0
    assert eta.low - now == pytest.approx(2000.0 * math.exp(-0.8))
    assert eta.high - now == pytest.approx(2000.0 * math.exp(0.8))
    # skewed errors (always late): the range lies above the planned start, the start kept in it
    late = _recorded([0.5 + 0.1 * k for k in range(19)])
    skewed = late.calibrated_range("q", now, now + 2000.0, submitted_at=now)
    assert skewed.low == now + 2000.0
    assert skewed.high - now == pytest.approx(2000.0 * math.exp(0.5 + 1.7))


def test_cold_start_is_wide_until_the_record_holds_min_samples() -> None:
    """No record, or fewer than min_samples errors in every stratum: [w / COLD_WIDEN, w · COLD_WIDEN]; the first
    record with min_samples tight errors narrows it (and a coarse start is widened on top)."""
    now = 50_000_000.0
    cold = EtaCalibration(window=100, min_samples=10).calibrated_range("q", now, now + 2000.0, now)
    assert (cold.low - now, cold.high - now) == pytest.approx((2000.0 / COLD_WIDEN, 2000.0 * COLD_WIDEN))
    tight = [0.05 * ((-1) ** k) for k in range(10)]
    few = _recorded(tight[:9]).calibrated_range("q", now, now + 2000.0, now)
    assert (few.low, few.high) == (cold.low, cold.high)
    warm = _recorded(tight).calibrated_range("q", now, now + 2000.0, now)
    assert cold.low < warm.low <= warm.start <= warm.high < cold.high
    coarse = _recorded(tight).calibrated_range("q", now, now + 2000.0, now, widen=1.5)
    assert coarse.low - now == pytest.approx((warm.low - now) / 1.5)
    assert coarse.high - now == pytest.approx((warm.high - now) * 1.5)


def test_the_range_is_monotone_in_the_observations() -> None:
    """Each error raised (or one more, larger error) never lowers either bound; more tight errors after the cold
    start never widen the range."""
    now = 50_000_000.0
    base = [0.1 * k for k in range(-9, 10)]
    before = _recorded(base).calibrated_range("q", now, now + 2000.0, now)
    raised = _recorded([e + 0.3 for e in base]).calibrated_range("q", now, now + 2000.0, now)
    assert raised.low >= before.low and raised.high >= before.high and raised.high > before.high
    more = _recorded([*base, 5.0]).calibrated_range("q", now, now + 2000.0, now)
    assert more.low >= before.low and more.high >= before.high
    widths = []
    for n in range(5, 40, 5):
        eta = _recorded([0.1 * ((-1) ** k) for k in range(n)]).calibrated_range("q", now, now + 2000.0, now)
        widths.append(eta.high - eta.low)
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1]


def test_the_record_of_the_queue_and_stratum_comes_first() -> None:
    """Queue a's errors are late, b's early: each queue's range follows its own record."""
    cal = EtaCalibration(window=100, min_samples=10)
    for i in range(30):
        given = 10_000.0 * i
        for queue, error in (("a", 1.0 + 0.01 * i), ("b", -1.0 - 0.01 * i)):
            cal.record(queue, given, EtaRange(given + 1000.0, given, given + 2000.0),
                       given + 1000.0 * math.exp(error), submitted_at=given)
    now = 1e9
    a = cal.calibrated_range("a", now, now + 1000.0, now)
    b = cal.calibrated_range("b", now, now + 1000.0, now)
    assert a.low == now + 1000.0 and a.high - now > 1000.0 * math.e
    assert b.high == now + 1000.0 and b.low - now < 1000.0 / math.e


def _counting_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs: list[int] = []
    run = eta_core._run  # (each replay runs to its end there, from scratch or from the shared first instant)

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(eta_core, "_run", counting)
    return runs


def test_calibrated_does_one_replay_a_refresh_with_the_same_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """300 waiting: the replays method runs three replays (median, p10, p90), calibrated one, and both give every
    waiting job the same start (the median replay, same head and budget share); calibrated's ranges hold it."""
    cluster, adm, ends = _deep_queue(300)
    view = {f"r{i}": RunningView(adm.admitted[f"r{i}"].spec, started_at=ends[f"r{i}"] - 3600.0) for i in range(8)}
    runs = _counting_runs(monkeypatch)
    replays = estimate_ranges(cluster, adm, view, 5.0, EtaModel(expect_arrivals=False), budget=6000)
    assert len(runs) == 3
    runs.clear()
    calibrated = estimate_ranges(cluster, adm, view, 5.0, EtaModel(expect_arrivals=False, range_method="calibrated"),
                                 budget=6000)
    assert len(runs) == 1
    assert {j: e.start for j, e in calibrated.items()} == {j: e.start for j, e in replays.items()}
    assert set(calibrated) == {f"p{i:04d}" for i in range(300)}
    for eta in calibrated.values():
        assert eta.low <= eta.start <= eta.high
        wait = max(60.0, eta.start - 5.0)
        assert eta.high - 5.0 >= wait * COLD_WIDEN - 1e-6  # (no record yet: the cold start)


def test_the_range_method_is_a_checked_setting() -> None:
    assert RANGE_METHODS[0] == "replays" and EtaModel().range_method == "replays"  # the default
    with pytest.raises(ValueError, match="range method"):
        EtaModel(range_method="p10")
    assert settings({}).eta_range_method == "replays"
    assert settings({"GPUQ_ETA_RANGE_METHOD": "calibrated"}).eta_range_method == "calibrated"
    with pytest.raises(SettingsError, match="GPUQ_ETA_RANGE_METHOD"):
        settings({"GPUQ_ETA_RANGE_METHOD": "quantiles"})


def test_starts_shown_and_made_within_a_minute_are_not_errors() -> None:
    """A start shown and made within a minute has no ratio (both waits floored): a record full of them leaves the
    range of the jobs with real waits as their own errors give it (not narrowed to nothing)."""
    errors = [round(0.1 * k, 1) for k in range(-9, 10)]
    cal = _recorded(errors)
    for i in range(100):  # (the window's 100 entries: kept, they would be all of it)
        given = 1e7 + 100.0 * i
        cal.record("q", given, EtaRange(given + 10.0, given, given + 20.0), given + 30.0, submitted_at=given)
    now = 50_000_000.0
    eta = cal.calibrated_range("q", now, now + 2000.0, submitted_at=now)
    assert eta.low - now == pytest.approx(2000.0 * math.exp(-0.8))
    assert eta.high - now == pytest.approx(2000.0 * math.exp(0.8))
