"""A cycle that finds the state as an earlier one left it answers from memory (`ClusterIndex.state_memo`): the
blocked head's placement attempt and reservation search are not redone, and the answers are exactly those
the computation gives. Any change to the state (commit, release, node update) drops what was remembered."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import services.core.scheduler.cycle as cycle_mod
from services.core.scheduler import ClusterState, CycleResult, PendingJob, Placement, RunningJob, schedule_cycle
from services.core.scheduler.index import MISSING, ClusterIndex
from shared.domain import NodeHealth
from tests.unit.scheduler.scheduler_builders import job, nodes
from tests.unit.scheduler.scheduler_strategies import SETTINGS


class Counting:
    """Counts the reservation searches and placement attempts `schedule_cycle` really runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.searches = 0
        self.attempts = 0
        search, attempt = cycle_mod.earliest_instant, cycle_mod.place_job

        def counted_search(*args):
            self.searches += 1
            return search(*args)

        def counted_attempt(*args):
            self.attempts += 1
            return attempt(*args)

        monkeypatch.setattr(cycle_mod, "earliest_instant", counted_search)
        monkeypatch.setattr(cycle_mod, "place_job", counted_attempt)


def _blocked_world() -> tuple[ClusterState, list[PendingJob], list[RunningJob]]:
    # Two 8-GPU nodes, 5 GPUs of each used by a running job; the head wants a whole node (blocked until t=100),
    # a 16-GPU job never fits before both end.
    state = ClusterState.from_nodes(nodes(2))
    for name, node in (("r1", "n-0"), ("r2", "n-1")):
        got = state.place(job(name, gpus=5, runtime=100 if name == "r1" else 200))
        assert isinstance(got, Placement) and got.bindings[0].node == node
        state.commit(got)
    pending = [PendingJob(job("head", gpus=8)), PendingJob(job("big", pods=2, gpus=8))]
    running = [RunningJob("r1", 100.0), RunningJob("r2", 200.0)]
    return state, pending, running


def _view(result: CycleResult) -> tuple[object, ...]:
    return (result.placed, sorted(result.reservations.items()), result.unplaceable)


def test_an_unchanged_state_does_not_search_again_and_answers_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    state, pending, running = _blocked_world()
    count = Counting(monkeypatch)
    first = schedule_cycle(state, pending, running, 10.0)
    assert first.reservations == {"head": 100.0}
    assert (count.searches, count.attempts) == (1, 2)
    again = schedule_cycle(state, pending, running, 20.0)
    assert (count.searches, count.attempts) == (1, 2)  # nothing changed: both answers come from memory
    assert _view(again) == _view(first)
    # time passes the reserved instant (r1 overruns): the reservation starts now, as the search would say
    late = schedule_cycle(state, pending, running, 150.0)
    assert late.reservations == {"head": 150.0}
    monkeypatch.setattr(ClusterIndex, "state_memo", lambda self, key: MISSING)
    assert _view(schedule_cycle(state, pending, running, 150.0)) == _view(late)


def test_any_change_to_the_state_drops_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    state, pending, running = _blocked_world()
    count = Counting(monkeypatch)
    schedule_cycle(state, pending, running, 10.0)
    # a what-if copy changes nothing on the original, and starts with no memory of its own
    what_if = state.copy()
    what_if.release("r1")
    schedule_cycle(state, pending, running, 10.0)
    assert count.searches == 1
    # a node update
    spec = state.node("n-1")
    state.upsert_node(spec.model_copy(update={"labels": {"x": "y"}}))
    schedule_cycle(state, pending, running, 10.0)
    assert count.searches == 2
    # a different timeline (a running job's estimate) is a different search
    schedule_cycle(state, pending, [RunningJob("r1", 120.0), running[1]], 10.0)
    assert count.searches == 3
    # a release: the head now fits and is placed (committed: the memory goes again)
    state.release("r1")
    result = schedule_cycle(state, pending, running[1:], 100.0)
    assert [p.job_id for p in result.placed] == ["head"]
    assert state.state_memo(("place", "head", ())) is MISSING  # dropped by the head's commit
    state.upsert_node(spec.model_copy(update={"health": NodeHealth.FAILED}))
    assert state.state_memo(("slot", "big", ())) is MISSING


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.integers(50, 400)), min_size=1, max_size=12),
       st.lists(st.sampled_from(["release", "cycle", "tick"]), min_size=1, max_size=10))
def test_cycles_with_memory_decide_what_cycles_without_it_decide(shapes: list[tuple[int, int, int]],
                                                                 steps: list[str]) -> None:
    """Two identical clusters take the same steps; one forgets everything between and within cycles. Every
    cycle's placements, reservations and reasons are equal."""
    states = [ClusterState.from_nodes(nodes(3)), ClusterState.from_nodes(nodes(3))]
    pending = [PendingJob(job(f"j{i}", pods=1 + pods % 2, gpus=gpus, runtime=rt))
               for i, (pods, gpus, rt) in enumerate(shapes)]
    running: list[list[RunningJob]] = [[], []]
    now = 0.0
    forget = ClusterIndex.state_memo
    for step in ["cycle", *steps, "cycle"]:
        now += 30.0
        results = []
        for side, state in enumerate(states):
            if step == "release":
                if running[side]:
                    state.release(running[side].pop(0).job_id)
                continue
            if side == 1:
                ClusterIndex.state_memo = lambda self, key: MISSING  # the reference forgets
            try:
                waiting = [p for p in pending if not state.holds(p.spec.job_id)]
                result = schedule_cycle(state, waiting, running[side], now)
            finally:
                ClusterIndex.state_memo = forget
            for p in result.placed:
                spec = next(pj.spec for pj in pending if pj.spec.job_id == p.job_id)
                running[side].append(RunningJob(p.job_id, now + spec.max_runtime_s))
            results.append(_view(result))
        if results:
            assert results[0] == results[1]
        assert states[0].fingerprint() == states[1].fingerprint()
