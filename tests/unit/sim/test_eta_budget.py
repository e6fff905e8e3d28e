"""The ETA's work budget (issue 49 item 5): a replay spends at most its budget of job-cycles whatever the queue's
depth; the head of the queue is replayed exactly, the far tail coarsely (list scheduling on the GPUs as they free
up) with a wider range; the caller's state is never changed."""

from __future__ import annotations

import pytest

from services.core.eta import EtaModel, RunningView, estimate_ranges, estimate_starts, plan_starts
from services.core.eta.eta import HEAD_CYCLES, TAIL_WIDEN

from .conftest import job
from .test_eta_accuracy import _count_cycles
from .test_eta_cli import _state_with


def _deep_queue(waiting: int):
    """8 GPUs busy with eight 1-GPU jobs ending over the next hour; `waiting` 1-GPU jobs of 10-40 minutes."""
    running = [job(f"r{i}", 0, 10, gpus_per_pod=1, estimate=3600) for i in range(8)]
    pending = [job(f"p{i:04d}", 5, 10, gpus_per_pod=1, estimate=600 + 60 * (i % 31)) for i in range(waiting)]
    cluster, adm = _state_with(running, pending, now=5.0)
    ends = {f"r{i}": 450.0 * (i + 1) for i in range(8)}
    return cluster, adm, ends


def test_a_replay_spends_at_most_its_budget_and_gives_the_tail_coarse_starts(monkeypatch):
    """1,000 waiting jobs: replayed exactly, 171 passes (ends a step apart grouped). With a budget of 600
    job-cycles the exact replay takes the head (600 // HEAD_CYCLES jobs) and stops within the budget (each pass
    costs at least the 8 running jobs: at most 76 passes); every job still gets a start, in the platform's order,
    and the coarse ones are close to the exact replay's (same GPUs, FIFO: within 25% of the wait)."""
    cluster, adm, ends = _deep_queue(1000)
    before = (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted))
    calls = _count_cycles(monkeypatch)
    exact = estimate_starts(cluster, adm, ends, now=5.0)
    exact_passes = calls[0]
    calls[0] = 0
    starts, coarse = plan_starts(cluster, adm, ends, now=5.0, budget=600)
    assert exact_passes > 100 and calls[0] <= 600 // 8 + 1  # the budget bounds the work (ignored: > 100)
    assert (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted)) == before  # pure
    assert set(starts) == set(exact) == {f"p{i:04d}" for i in range(1000)}
    head = 600 // HEAD_CYCLES
    assert coarse >= {f"p{i:04d}" for i in range(head, 1000)}  # the tail beyond the head: coarse
    assert not coarse & {f"p{i:04d}" for i in range(head // 2)}  # the first of the head: exact
    tail = [starts[f"p{i:04d}"] for i in range(head, 1000)]
    assert tail == sorted(tail)  # FIFO: in the platform's order
    for job_id in sorted(coarse):
        assert starts[job_id] - 5.0 == pytest.approx(exact[job_id] - 5.0, rel=0.25), job_id
    assert estimate_starts(cluster, adm, ends, now=5.0, budget=600) == starts
    # uncut (no tail given: the whole queue in the replay), the budget alone stops the replay: the jobs it has
    # not started by then get coarse starts
    calls[0] = 0
    uncut, rough = plan_starts(cluster, adm, ends, now=5.0, budget=600, tail=[])
    assert calls[0] <= 600 // 8 + 1 and set(uncut) == set(exact) and len(rough) > 900
    with pytest.raises(ValueError, match="budget"):
        plan_starts(cluster, adm, ends, now=5.0, budget=0)


def test_a_queue_within_the_budget_is_replayed_exactly_as_without_one():
    """A short queue (under the head, and affordable at the default resolution): the same starts as the exact
    replay, none coarse."""
    cluster, adm, ends = _deep_queue(20)
    starts, coarse = plan_starts(cluster, adm, ends, now=5.0, budget=1_000_000)
    assert starts == estimate_starts(cluster, adm, ends, now=5.0) and coarse == frozenset()


def test_coarse_starts_get_a_range_wider_by_the_tail_factor():
    """Without predictions (every run its limit: the three replays agree) an exact start's range is the start
    itself; a coarse one's is its wait divided by TAIL_WIDEN to multiplied by it."""
    cluster, adm, ends = _deep_queue(300)
    view = {f"r{i}": RunningView(adm.admitted[f"r{i}"].spec, started_at=ends[f"r{i}"] - 3600.0) for i in range(8)}
    model = EtaModel(predict=False, calibrate=False, expect_arrivals=False, expect_preemption=False)
    etas = estimate_ranges(cluster, adm, view, 5.0, model, budget=600)
    first, last = etas["p0000"], etas["p0299"]
    assert first.low == first.start == first.high
    wait = last.start - 5.0
    assert last.low == pytest.approx(5.0 + wait / TAIL_WIDEN) and last.high == pytest.approx(5.0 + wait * TAIL_WIDEN)
    exact = estimate_ranges(cluster, adm, view, 5.0, model, budget=None)["p0299"]
    assert exact.low == exact.start == exact.high
