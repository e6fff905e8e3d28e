"""The reservation search (`earliest_slot`) answers exactly what the straightforward replay answers: attempt a
full placement after every expected end, first success wins. Its gate only decides where the placer runs."""

from __future__ import annotations

from collections.abc import Sequence
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

import services.core.scheduler.slot as slot
from services.core.scheduler import ClusterState, PendingJob, Placement, Reservation, earliest_slot
from services.core.scheduler.placer import exclusions_for, place_job, resolve, trim, try_place
from shared.domain import NodeHealth, NodeSpec
from tests.unit.scheduler.scheduler_builders import job, nodes
from tests.unit.scheduler.scheduler_strategies import MODELS, SETTINGS, clusters, jobs


def replay(state: ClusterState, pj: PendingJob, timeline: Sequence[tuple[float, str]],
           earlier: Sequence[Reservation], now: float) -> Reservation | None:
    """The reference: release each instant's expected ends on a copy, then attempt the placement."""
    exclude = exclusions_for(r.placement for r in earlier) if earlier else None
    future = state.copy()
    events = sorted(e for e in timeline if future.holds(e[1]))
    i = 0
    while i < len(events):
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            future.release(events[i][1])
            i += 1
        got = place_job(future, pj.spec, pj.allowed_models, exclude)
        if isinstance(got, Placement):
            start = max(now, t)
            return Reservation(pj.spec.job_id, start, start + pj.spec.max_runtime_s, got)
    return None


class CountingPlacer:
    """Wraps the placer the search calls: how many attempts, and how many of them failed."""

    def __init__(self) -> None:
        self.calls = 0
        self.failed = 0

    def __call__(self, *args: object, **kwargs: object) -> Placement | None:
        got = try_place(*args, **kwargs)  # type: ignore[arg-type]
        self.calls += 1
        self.failed += got is None
        return got


def search(state: ClusterState, pj: PendingJob, timeline: Sequence[tuple[float, str]],
           earlier: Sequence[Reservation], now: float) -> tuple[Reservation | None, CountingPlacer]:
    counter = CountingPlacer()
    with mock.patch.object(slot, "try_place", counter):
        return earliest_slot(state, pj, timeline, earlier, now), counter


@given(data=st.data(), cluster=clusters(), strategy=st.sampled_from(("binpack", "spread")))
@SETTINGS
def test_the_search_gives_the_reservation_of_the_straightforward_replay(
        data: st.DataObject, cluster: list[NodeSpec], strategy: str) -> None:
    state = ClusterState.from_nodes(cluster, strategy=strategy)
    timeline: list[tuple[float, str]] = []
    for i in range(data.draw(st.integers(0, 14))):
        p = state.place(data.draw(jobs(f"r{i}")))
        if isinstance(p, Placement):
            state.commit(p)
            timeline.append((float(data.draw(st.integers(0, 8)) * 500), p.job_id))  # ties and past ends
    if timeline and data.draw(st.booleans()):
        timeline.append((float(data.draw(st.integers(0, 8)) * 500), data.draw(st.sampled_from(timeline))[1]))
    timeline.append((1000.0, "ghost"))  # not running: ignored
    if data.draw(st.integers(0, 3)) == 0:
        # A node changes under its allocations (cordoned, or fewer GPUs): what it can still give back differs.
        node = data.draw(st.sampled_from(cluster))
        changed = data.draw(st.sampled_from((
            node.model_copy(update={"health": NodeHealth.CORDONED}),
            node.model_copy(update={"health": NodeHealth.READY}),
            node.model_copy(update={"gpus": node.gpus // 2}))))
        state.upsert_node(changed)
    now = 1200.0
    earlier: list[Reservation] = []
    if data.draw(st.booleans()):
        first = replay(state, PendingJob(data.draw(jobs("first"))), timeline, [], now)
        if first is not None:
            earlier.append(first)
    pj = PendingJob(data.draw(jobs("head")), data.draw(st.sampled_from(((), ("H100-80GB",), MODELS))))
    before = state.fingerprint()
    expected = replay(state, pj, timeline, earlier, now)
    got, placer = search(state, pj, timeline, earlier, now)
    assert got == expected
    assert state.fingerprint() == before  # the search is a pure query
    reqs = resolve(pj.spec, pj.allowed_models)
    if isinstance(reqs, list) and len(trim(reqs, pj.spec.gang_size)) == 1:
        # One pod set must start: the gate is exact, the placer runs once, at the answer, or never.
        assert placer.failed == 0 and placer.calls == (got is not None)


def busy_cluster(count: int = 200) -> tuple[ClusterState, list[tuple[float, str]]]:
    """`count` 8-GPU nodes with 32 CPU cores each, full of 1-GPU jobs ending one after another."""
    state = ClusterState.from_nodes(nodes(count, cpu=32_000))
    timeline = []
    for i in range(count * 8):
        p = state.place(job(f"r{i}", cpu=2000))
        assert isinstance(p, Placement)
        state.commit(p)
        timeline.append((float(1000 + i), p.job_id))
    return state, timeline


def test_a_head_limited_by_cpu_is_answered_without_a_placement_attempt() -> None:
    state, timeline = busy_cluster()
    head = PendingJob(job("head", gpus=1, cpu=48_000))  # no node has 48 cores: it never fits
    got, placer = search(state, head, timeline, [], 0.0)
    assert got is None and placer.calls == 0
    assert replay(state, head, timeline[:50], [], 0.0) is None  # the reference agrees (on a prefix: it is slow)


def test_the_placer_runs_once_at_the_answer() -> None:
    state, timeline = busy_cluster()
    head = PendingJob(job("head", pods=2, gpus=8, cpu=8000, required="rack"))  # two whole nodes of one rack
    got, placer = search(state, head, timeline, [], 0.0)
    assert got == replay(state, head, timeline, [], 0.0)
    assert got is not None and placer.calls == 1
    # Racks of 4 nodes fill (and empty) in rank order: the first rack has two empty nodes after 16 ends.
    assert got.start == 1015.0 and got.placement.racks_spanned == 1


def test_a_gang_with_min_members_reserves_when_its_first_pods_fit() -> None:
    # Two full 8-GPU nodes ending at 2000 and 5000; a gang of 2×8 GPUs that may start with one pod.
    state = ClusterState.from_nodes(nodes(2))
    for jid in ("r0", "r1"):
        p = state.place(job(jid, gpus=8))
        assert isinstance(p, Placement)
        state.commit(p)
    timeline = [(2000.0, "r0"), (5000.0, "r1")]
    head = PendingJob(job("head", pods=2, gpus=8, min_members=1))
    got, _ = search(state, head, timeline, [], 1000.0)
    # The placer starts the first pod at 2000 (the whole gang's 16 GPUs are not needed to start).
    assert got == replay(state, head, timeline, [], 1000.0)
    assert got is not None and got.start == 2000.0 and len(got.placement.bindings) == 1


def test_a_node_change_is_seen_by_the_cached_never_fits_verdict() -> None:
    state, timeline = busy_cluster(8)
    head = PendingJob(job("head", gpus=1, cpu=48_000))
    assert search(state, head, timeline, [], 0.0)[0] is None  # no node has 48 cores, whatever ends
    bigger = state.node("n-3").model_copy(update={"cpu_milli": 64_000})
    state.upsert_node(bigger)  # keeps its 8 jobs (16 cores): the head fits when the first of them ends
    got, _ = search(state, head, timeline, [], 0.0)
    assert got == replay(state, head, timeline, [], 0.0)
    assert got is not None and got.placement.nodes == ("n-3",)
