"""Backfill with reservations (Slurm EASY): the head's planned start is never delayed by later jobs."""

from __future__ import annotations

from services.core.scheduler import (
    ClusterState,
    PendingJob,
    Placement,
    Reason,
    RunningJob,
    schedule_cycle,
)
from tests.unit.scheduler.scheduler_builders import job, nodes

NOW = 1000.0


def busy_cluster() -> tuple[ClusterState, list[RunningJob]]:
    """Two 8-GPU nodes; n-0 fully busy until t=2000, n-1 has 4 GPUs busy until t=5000."""
    state = ClusterState.from_nodes(nodes(2))
    for jid, gpus in (("r0", 8), ("r1", 4)):
        p = state.place(job(jid, gpus=gpus))
        assert isinstance(p, Placement)
        state.commit(p)
    return state, [RunningJob("r0", 2000.0), RunningJob("r1", 5000.0)]


def test_head_gets_a_reservation_and_short_jobs_backfill() -> None:
    state, running = busy_cluster()
    head = job("head", gpus=8)  # fits only when r0 ends at t=2000
    short = job("short", gpus=4, runtime=500)  # ends at 1500 < 2000: cannot delay the head
    result = schedule_cycle(state, [PendingJob(head), PendingJob(short)], running, NOW)
    assert result.reservations == {"head": 2000.0}
    assert [p.job_id for p in result.placed] == ["short"]
    [why] = result.unplaceable
    assert why.job_id == "head" and why.reason == Reason.INSUFFICIENT_GPUS
    assert "reserved to start at 1970-01-01 00:33:20 UTC" in why.message  # a human, zoned time, no epoch
    assert "short" in state.allocations()


def test_a_long_job_on_reserved_gpus_waits_for_the_reservation() -> None:
    state, running = busy_cluster()
    head = job("head", pods=12, gpus=1)  # needs n-0 (free at 2000) plus the 4 free GPUs of n-1
    long = job("long", gpus=4, runtime=10_000)
    result = schedule_cycle(state, [PendingJob(head), PendingJob(long)], running, NOW)
    assert result.reservations == {"head": 2000.0}
    assert result.placed == []
    waiting = {u.job_id: u for u in result.unplaceable}
    assert waiting["long"].reason == Reason.WAITING_FOR_RESERVATION
    assert "reserved for head from 1970-01-01 00:33:20 UTC" in waiting["long"].message


def test_a_long_job_may_use_capacity_the_reservation_does_not_need() -> None:
    state, running = busy_cluster()
    head = job("head", gpus=8)  # reservation on n-0 at t=2000: n-1's 4 free GPUs are not needed
    long = job("long", gpus=4, runtime=10_000)
    result = schedule_cycle(state, [PendingJob(head), PendingJob(long)], running, NOW)
    assert [p.job_id for p in result.placed] == ["long"]
    assert result.placed[0].bindings[0].node == "n-1"
    # The reservation still holds: after r0 ends, the head fits at its planned time.
    state.release("r0")
    assert isinstance(state.place(head), Placement)


def test_without_backfill_the_head_blocks_later_jobs() -> None:
    state, running = busy_cluster()
    head = job("head", gpus=8)
    short = job("short", gpus=1, runtime=10)
    result = schedule_cycle(state, [PendingJob(head), PendingJob(short)], running, NOW, backfill=False)
    assert result.placed == []
    assert {u.job_id: u.reason for u in result.unplaceable} == {
        "head": Reason.INSUFFICIENT_GPUS, "short": Reason.WAITING_FOR_RESERVATION}


def test_a_job_that_can_never_fit_reserves_nothing_and_blocks_nothing() -> None:
    state, running = busy_cluster()
    huge = job("huge", pods=3, gpus=8)
    other = job("other", gpus=2, runtime=99_999)
    result = schedule_cycle(state, [PendingJob(huge), PendingJob(other)], running, NOW)
    assert result.reservations == {}
    assert [p.job_id for p in result.placed] == ["other"]


def test_second_reservation_is_planned_after_the_first() -> None:
    state, running = busy_cluster()
    a = job("a", gpus=8, runtime=3000)
    b = job("b", gpus=8, runtime=3000)
    result = schedule_cycle(state, [PendingJob(a), PendingJob(b)], running, NOW, max_reservations=2)
    # a takes n-0 at 2000; b must avoid a's GPUs and waits for n-1 to empty at 5000.
    assert result.reservations == {"a": 2000.0, "b": 5000.0}


def test_cycle_places_in_order_and_reports_every_job() -> None:
    state = ClusterState.from_nodes(nodes(1))
    pending = [PendingJob(job(f"j{i}", gpus=3)) for i in range(4)]
    result = schedule_cycle(state, pending, [], NOW)
    assert [p.job_id for p in result.placed] == ["j0", "j1"]
    assert sorted(u.job_id for u in result.unplaceable) == ["j2", "j3"]
    # j2 gets a reservation at the end of j0 (now + max_runtime_s), j3 is explained only.
    assert result.reservations == {"j2": NOW + 3600}
