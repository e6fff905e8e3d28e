"""Wait-time aging within a priority (services/core/admission/ordering.py, aged_order_time; policy.max_age_s):
a job's duration offset shrinks with its wait, so a long job that waited is no longer passed by shorter jobs
that arrive later, and once it waited max_age_s nothing submitted after it passes it. Off (null): unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission.ordering import aged_order_time
from shared.config import QueuesConfig
from tests.unit.admission.admission_core_builders import H100, config, job, queue


def with_max_age(max_age_s: int | None) -> QueuesConfig:
    base = config(queue("a", {H100: 1}, cohort=None))
    return base.model_copy(update={"policy": base.policy.model_copy(update={"max_age_s": max_age_s})})


def admitted(state: AdmissionState, now: float) -> list[str]:
    return [a.job_id for a in admission_cycle(state, now).admitted]


def long_then_short(max_age_s: int | None) -> AdmissionState:
    """A long job (offset 10,000 s on the 1-GPU queue) waiting 6,000 s when a short one arrives."""
    state = AdmissionState(with_max_age(max_age_s))
    state.submit(Workload(job("long", "a"), 0.0, predicted_gpu_s=10_000.0))
    state.submit(Workload(job("short", "a"), 6_000.0, predicted_gpu_s=100.0))
    return state


def test_without_aging_a_shorter_later_job_passes_a_long_job_that_waited() -> None:
    assert admitted(long_then_short(None), 6_001.0) == ["short"]  # 6,100 < 10,000


def test_with_aging_the_long_job_that_waited_goes_first() -> None:
    # aged: 0 + 10,000 x (1 - 6,001/8,000) ≈ 2,499 < 6,100: its wait earned it the place (fails on the old core)
    assert admitted(long_then_short(8_000), 6_001.0) == ["long"]


def test_after_max_age_no_later_job_passes() -> None:
    state = AdmissionState(with_max_age(1_000))
    state.submit(Workload(job("long", "a"), 0.0, predicted_gpu_s=1e9))
    state.submit(Workload(job("tiny", "a"), 1_000.0, predicted_gpu_s=0.0))  # same instant it saturates
    assert admitted(state, 1_000.0) == ["long"]


def test_aging_changes_nothing_without_predictions() -> None:
    for max_age in (None, 10):
        state = AdmissionState(with_max_age(max_age))
        state.submit(Workload(job("first", "a"), 0.0))
        state.submit(Workload(job("second", "a"), 5.0))
        assert admitted(state, 1e6) == ["first"]


def test_aged_order_time_checks_its_input() -> None:
    assert aged_order_time(0.0, 100.0, 50.0, None) == 100.0
    assert aged_order_time(0.0, 100.0, 50.0, 100) == pytest.approx(50.0)
    assert aged_order_time(0.0, 100.0, 500.0, 100) == 0.0
    assert aged_order_time(0.0, 100.0, -5.0, 100) == 100.0  # never later than the un-aged time
    with pytest.raises(ValueError, match="max_age_s"):
        aged_order_time(0.0, 100.0, 50.0, 0)


times = st.floats(min_value=0, max_value=1e6, allow_nan=False)
offsets = st.floats(min_value=0, max_value=1e6, allow_nan=False)
ages = st.floats(min_value=1, max_value=1e6, allow_nan=False)


@given(t_j=times, d_j=offsets, delay=times, d_k=offsets, max_age=ages, t1=times, later=times)
@settings(max_examples=300)
def test_a_later_job_behind_never_overtakes(t_j: float, d_j: float, delay: float, d_k: float, max_age: float,
                                             t1: float, later: float) -> None:
    """J submitted before K: if J is ahead of (or level with) K at some instant, it stays so ever after, and its
    own key never gets worse while it waits."""
    t_k = t_j + delay
    now = max(t_k, t1)
    key_j = aged_order_time(t_j, t_j + d_j, now, max_age)
    key_k = aged_order_time(t_k, t_k + d_k, now, max_age)
    after_j = aged_order_time(t_j, t_j + d_j, now + later, max_age)
    after_k = aged_order_time(t_k, t_k + d_k, now + later, max_age)
    assert after_j <= key_j
    tol = 1e-9 * max(1.0, abs(t_j), abs(t_k), d_j, d_k)
    if key_j <= key_k:
        assert after_j <= after_k + tol
    if now + later - t_j >= max_age:  # J waited max_age: nothing submitted after it is ahead
        assert after_j <= t_k


@given(arrivals=st.lists(st.tuples(st.floats(min_value=0, max_value=500, allow_nan=False),
                                   st.floats(min_value=0, max_value=5_000, allow_nan=False)),
                         min_size=1, max_size=12),
       max_age=st.integers(min_value=1, max_value=2_000))
@settings(max_examples=100, deadline=None)
def test_nothing_starves_in_the_core(arrivals: list[tuple[float, float]], max_age: int) -> None:
    """A queue whose one GPU is held admits nothing more: a watched job's position in its queue, as the core
    reports it, never gets worse once it waited max_age_s, however many later jobs of its class arrive."""
    state = AdmissionState(with_max_age(max_age))
    state.submit(Workload(job("blocker", "a", priority="high"), 0.0))
    assert admitted(state, 0.0) == ["blocker"]
    state.submit(Workload(job("watched", "a"), 0.0, predicted_gpu_s=4_000.0))
    now, best = 0.0, None
    for i, (gap, predicted) in enumerate(arrivals):
        now += gap
        state.submit(Workload(job(f"k{i:02d}", "a"), now, predicted_gpu_s=predicted))
        pos = admission_cycle(state, now).pending["watched"].position_in_queue
        if now >= max_age:
            assert best is None or pos <= best
            best = pos
