"""Waits and ETAs as the read model tells them at a given time (issue 51): no frozen waits, no ETA in the past."""

from __future__ import annotations

from typing import Any

from services.api.readmodel import eta_text, eta_view, explain_lines, wait_seconds


def _row(state: str, **extra: Any) -> dict[str, Any]:
    return {"job_id": "j", "team": "t", "queue": "q", "state": state, "submitted_at": 1000.0,
            "admitted_at": 1100.0 if state != "pending" else None, "placed_at": None, "started_at": None,
            "finished_at": None, "eta": None, "eta_low": None, "eta_high": None,
            "spec": {"pod_sets": [{"count": 1, "gpus_per_pod": 8}], "priority_class": "normal",
                     "max_runtime_s": 3600}, **extra}


def test_an_admitted_or_placed_job_keeps_counting_its_wait() -> None:
    for state, extra in (("admitted", {}), ("placed", {"placed_at": 1200.0})):
        row = _row(state, **extra)
        assert wait_seconds(row, 1500.0) == 500.0 and wait_seconds(row, 1900.0) == 900.0


def test_a_job_that_runs_or_ran_shows_its_wait_until_its_start() -> None:
    running = _row("running", placed_at=1200.0, started_at=1230.0)
    assert wait_seconds(running, 5000.0) == wait_seconds(running, 9000.0) == 230.0
    done = _row("completed", placed_at=1200.0, started_at=1230.0, finished_at=4000.0)
    assert wait_seconds(done, 9000.0) == 230.0
    never_ran = _row("cancelled", admitted_at=None, finished_at=1300.0)
    assert wait_seconds(never_ran, 9000.0) == 300.0


def test_a_passed_eta_is_clamped_to_now_and_flagged() -> None:
    row = _row("admitted", eta=1400.0, eta_low=1350.0, eta_high=1800.0)
    view = eta_view(row, 1500.0)
    assert view == {"eta": 1500.0, "eta_low": 1500.0, "eta_high": 1800.0, "eta_overdue": True,
                    "eta_expected": 1400.0}
    assert eta_view(row, 1300.0)["eta_overdue"] is False  # not yet passed: as admission gave it
    words = eta_text(row, 1500.0)
    assert "overdue" in words and "1970-01-01 00:23:20 UTC" in words
    lines = "\n".join(explain_lines(row, 1500.0))
    assert "overdue" in lines and "waited 500 s so far" in lines


def test_explain_never_shows_a_time_in_the_past_and_a_range_of_nothing_as_one_time() -> None:
    """Issue 49 item 5: the start ahead but its range's low end passed: the range starts now, not in the past; a
    degenerate range (low = high = the start, or equal to the second) reads as one time, not 'between X and X'."""
    row = _row("pending", eta=1600.0, eta_low=1200.0, eta_high=1900.0)
    view = eta_view(row, 1500.0)
    assert (view["eta"], view["eta_low"], view["eta_high"], view["eta_overdue"]) == (1600.0, 1500.0, 1900.0, False)
    words = eta_text(row, 1500.0)
    assert "00:20:00" not in words and "likely between 1970-01-01 00:25:00 UTC" in words  # now, not 1200
    one = eta_text(_row("pending", eta=1600.0, eta_low=1600.0, eta_high=1600.0), 1500.0)
    assert one == "1970-01-01 00:26:40 UTC"
    same_second = eta_text(_row("pending", eta=1600.2, eta_low=1600.0, eta_high=1600.4), 1500.0)
    assert "between" not in same_second
    lines = "\n".join(explain_lines(_row("pending", eta=1600.0, eta_low=1600.0, eta_high=1600.0, reason="Quota",
                                          message=""), 1500.0))
    assert "expected start 1970-01-01 00:26:40 UTC" in lines and "between" not in lines
