"""A refresh's work budget (issue 49 item 5): the three replays of one refresh (median, p10, p90) share one budget
of job-cycles, the tail beyond the head of the queue is replayed coarsely once (the median's durations) with a
range widened twice; the expected-arrivals delay a refresh asks for every waiting job reuses, per (queue,
priority, models), the groups of arrivals that compete, with the same result as finding them per job."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import services.core.eta.eta as eta_core
from services.core.eta import EtaModel, RunningView, estimate_ranges
from services.core.eta.eta import HEAD_CYCLES, TAIL_WIDEN, Arrival, ArrivalHistory

from .test_eta_budget import _deep_queue


def _model() -> EtaModel:
    return EtaModel(calibrate=False, expect_arrivals=False, expect_preemption=False)


def _view(adm: Any, ends: dict[str, float]) -> dict[str, RunningView]:
    return {f"r{i}": RunningView(adm.admitted[f"r{i}"].spec, started_at=ends[f"r{i}"] - 3600.0) for i in range(8)}


def test_the_three_replays_of_a_refresh_share_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 waiting: the median replay spends about half the refresh's budget, the p10 and p90 replays half of
    what it left each; all together within the budget plus one pass each (a pass costs the head and the running
    jobs). Each replay spending the whole budget (the old rule) spent about three budgets."""
    cluster, adm, ends = _deep_queue(1000)
    budget = 30_000  # (a head of 250 jobs: replaying it whole costs more than the budget)
    spent: list[tuple[int, int]] = []
    run = eta_core._run  # (each replay runs to its end there, from scratch or from the shared first instant)

    def counting(*args: Any, **kwargs: Any) -> Any:
        out = run(*args, **kwargs)
        spent.append((kwargs["budget"], out[2]))
        return out

    monkeypatch.setattr(eta_core, "_run", counting)
    etas = estimate_ranges(cluster, adm, _view(adm, ends), 5.0, _model(), budget=budget)
    assert len(spent) == 3 and spent[0][0] == budget // 2
    one_pass = (budget // 2) // HEAD_CYCLES + 8 + 1
    assert spent[1][0] == spent[2][0] == (budget - spent[0][1]) // 2
    assert all(cost >= share for share, cost in spent[1:])  # the p10 and p90 replays were cut by their share
    assert sum(cost for _share, cost in spent) <= budget + 3 * one_pass
    assert set(etas) == {f"p{i:04d}" for i in range(1000)}  # every waiting job still gets an ETA


def test_the_tail_gets_its_range_from_its_coarse_start_widened_twice() -> None:
    """With predictions on, a job beyond the head has no p10 / p90 replay: its range is its coarse wait divided by
    TAIL_WIDEN squared to multiplied by it; a job of the head keeps its replayed range."""
    cluster, adm, ends = _deep_queue(300)
    etas = estimate_ranges(cluster, adm, _view(adm, ends), 5.0, _model(), budget=1200)
    last = etas["p0299"]
    wait = last.start - 5.0
    assert wait > 0
    assert last.low == pytest.approx(5.0 + wait / TAIL_WIDEN ** 2)
    assert last.high == pytest.approx(5.0 + wait * TAIL_WIDEN ** 2)
    first = etas["p0000"]
    assert first.low <= first.start <= first.high and first.high - first.low < wait


_MODELS = st.sampled_from([(), ("A",), ("B",), ("A", "B")])


@settings(max_examples=150, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from(["q1", "q2"]), st.floats(0, 10_000), st.integers(0, 3),
                                   st.floats(1, 1e6), _MODELS), max_size=40),
       asks=st.lists(st.tuples(st.sampled_from(["q1", "q2", "q3"]), st.integers(-1, 3), st.floats(0, 20_000),
                               _MODELS), min_size=1, max_size=30),
       pools=st.sampled_from([{"A": 8}, {"A": 8, "B": 16}, {"B": 0}]))
def test_the_shared_delay_memo_gives_what_each_job_alone_would_get(arrivals: Any, asks: Any, pools: Any) -> None:
    """The memo a refresh keeps for `expected_delay` (the competing groups per queue, priority and models) gives
    the same delay, to the last bit, as asking without it, whatever the history and the order of the asks."""
    now = 10_000.0
    history = ArrivalHistory()
    history.observe_many([(q, Arrival(at, f"j{i}", prio, work, models))
                          for i, (q, at, prio, work, models) in enumerate(arrivals)], now)
    memo: dict[object, object] = {}
    for queue, priority, wait, models in asks:
        alone = history.expected_delay(queue, priority, now, wait, pools, models)
        assert history.expected_delay(queue, priority, now, wait, pools, models, memo) == alone
