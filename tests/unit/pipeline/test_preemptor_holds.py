"""Freed GPUs go to the preemptor that asked for them (issue 51): the capacity a preemption frees is held for its
preemptor, and another team's admitted job, first in the placement order, is placed around it or waits."""

from __future__ import annotations

from services.core.pipeline import PlacementBook, WaitingJob, place_ordered
from services.core.scheduler import ClusterState, Hold, Placement, Reason
from tests.unit.scheduler.scheduler_builders import job, nodes

NOW = 10_000.0


def _scenario(free_nodes: int = 0) -> tuple[ClusterState, Placement, PlacementBook]:
    """One 8-GPU node (plus `free_nodes` idle ones) held by team A's low-priority job `a-low`, which team A's
    high-priority job `a-high` has just preempted; team B's `b-job` was admitted first and waits for 8 GPUs."""
    cluster = ClusterState.from_nodes(nodes(1 + free_nodes))
    low = cluster.place(job("a-low", gpus=8))
    assert isinstance(low, Placement)
    cluster.commit(low)
    book = PlacementBook()
    b = job("b-job", gpus=8).model_copy(update={"team": "team-b", "queue": "team-b"})
    book.wait(WaitingJob(spec=b, allowed_models=(), priority=100, admitted_at=NOW - 600))
    cluster.release("a-low")  # JobPreempted: the victim's GPUs are free again
    return cluster, low, book


def _cycle(cluster: ClusterState, book: PlacementBook, holds: list[Hold], now: float = NOW) -> list[str]:
    got = place_ordered(cluster, book.pending, book.priority, book.timeline, now, holds=holds)
    for p in got.result.placed:
        book.unwait(p.job_id)
    return [p.job_id for p in got.result.placed]


def test_freed_gpus_wait_for_the_preemptor_and_go_to_it() -> None:
    cluster, low, book = _scenario()
    hold = Hold(preemptor="a-high", victim="a-low", placement=low, until=NOW + 300)
    # The scheduler's cycle on JobPreempted, before admission has admitted a-high: b-job would fit on the freed
    # node (and was placed there before the hold), but it is a-high's.
    assert _cycle(cluster, book, [hold]) == []
    outcome = place_ordered(cluster, book.pending, book.priority, book.timeline, NOW, holds=[hold])
    [why] = outcome.result.unplaceable
    assert why.job_id == "b-job" and why.reason == Reason.WAITING_FOR_RESERVATION
    assert "held for a-high, which preempted a-low" in why.message and "t=" not in why.message
    # a-high's admission reaches the scheduler: it takes the freed GPUs even though b-job is first in the order
    high = job("a-high", gpus=8)
    book.wait(WaitingJob(spec=high, allowed_models=(), priority=1000, admitted_at=NOW + 1))
    assert _cycle(cluster, book, [hold], NOW + 1) == ["a-high"]
    assert cluster.placement_of("a-high") is not None and "b-job" in book.waiting


def test_other_jobs_are_placed_around_a_hold() -> None:
    cluster, low, book = _scenario(free_nodes=1)
    hold = Hold(preemptor="a-high", victim="a-low", placement=low, until=NOW + 300)
    assert _cycle(cluster, book, [hold]) == ["b-job"]
    placed = cluster.placement_of("b-job")
    assert placed is not None and placed.nodes == ("n-1",)  # not on the node freed for a-high


def test_an_expired_hold_holds_nothing() -> None:
    cluster, low, book = _scenario()
    hold = Hold(preemptor="a-high", victim="a-low", placement=low, until=NOW)
    assert _cycle(cluster, book, [hold]) == ["b-job"]
