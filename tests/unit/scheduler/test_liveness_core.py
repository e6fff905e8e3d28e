"""The liveness rule: a job is lost when its executor, heard after the placement, has left it out of its heartbeats
for longer than the timeout, or when it is placed past the runtime limit plus grace. Silence alone (no executor
heard) condemns nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.scheduler.liveness import ExecutorRound, LivenessSettings, WatchedJob, lost_jobs

SETTINGS = LivenessSettings(heartbeat_timeout_s=60.0, runtime_grace_s=300.0)


def job(job_id: str, *, placed_at: float = 0.0, max_runtime_s: float = 3600.0, last_heard: float = 0.0) -> WatchedJob:
    return WatchedJob(job_id=job_id, placed_at=placed_at, max_runtime_s=max_runtime_s, last_heard=last_heard)


def heard(at: float, *, sent_at: float = 1e9) -> ExecutorRound:
    """The executor's latest complete heartbeat, heard at `at` (watch clock), sent at `sent_at` (services' clock)."""
    return ExecutorRound(executor="executor/sim", heard_at=at, sent_at=sent_at)


def test_jobs_the_executor_leaves_out_and_overrunning_jobs_are_lost_others_are_not() -> None:
    jobs = [job("heard", last_heard=100.0), job("silent", last_heard=30.0),
            job("overran", placed_at=0.0, max_runtime_s=1000.0, last_heard=100.0),
            job("in-grace", placed_at=0.0, max_runtime_s=1002.0, last_heard=100.0)]
    lost = lost_jobs(jobs, now=1301.0, heard_now=100.0, settings=SETTINGS, latest=heard(100.0))
    assert [v.job_id for v in lost] == ["overran", "silent"]  # sorted by id: a deterministic order
    assert "no executor heartbeat" in lost[1].message and "70 s" in lost[1].message
    assert "executor/sim reported 0 s ago without it" in lost[1].message
    assert "past max_runtime_s=1000" in lost[0].message


def test_an_executor_not_heard_condemns_no_job() -> None:
    """The scheduler hears nothing (its executor is down, or the bus is): the jobs' pods run on; only the runtime
    limit still counts."""
    jobs = [job("a", last_heard=0.0), job("overran", max_runtime_s=10.0, last_heard=0.0)]
    lost = lost_jobs(jobs, now=311.0, heard_now=10_000.0, settings=SETTINGS, latest=None)
    assert [v.job_id for v in lost] == ["overran"]
    # Heard last before the job's silence passed the timeout: the executor has not said anything about it since.
    assert lost_jobs([job("a", last_heard=0.0)], now=0.0, heard_now=10_000.0, settings=SETTINGS,
                     latest=heard(60.0)) == []


def test_a_heartbeat_sent_before_the_placement_does_not_speak_for_the_job() -> None:
    """A heartbeat written before the executor could know of the placement (published late, after an outage)
    leaves the job out without saying anything about it."""
    placed = job("new", placed_at=1000.0, last_heard=0.0)
    assert lost_jobs([placed], now=1000.0, heard_now=500.0, settings=SETTINGS, latest=heard(500.0, sent_at=999.0)) \
        == []
    assert [v.job_id for v in lost_jobs([placed], now=1000.0, heard_now=500.0, settings=SETTINGS,
                                        latest=heard(500.0, sent_at=1000.0))] == ["new"]


def test_exactly_at_the_timeout_is_not_yet_lost() -> None:
    assert lost_jobs([job("a", last_heard=0.0)], now=0.0, heard_now=60.0, settings=SETTINGS, latest=heard(60.0)) == []
    assert lost_jobs([job("a", max_runtime_s=10.0)], now=310.0, heard_now=0.0, settings=SETTINGS) == []


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        LivenessSettings(heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="runtime_grace_s"):
        LivenessSettings(runtime_grace_s=-1)


@given(st.lists(st.tuples(st.floats(0, 1e5), st.floats(0, 1e5)), max_size=20), st.floats(0, 2e5),
       st.one_of(st.none(), st.tuples(st.floats(0, 2e5), st.floats(0, 2e5))))
def test_a_job_the_executor_listed_within_the_timeout_and_inside_its_limit_is_never_lost(
        heard_at: list[tuple[float, float]], now: float, latest_round: tuple[float, float] | None) -> None:
    """Whatever the executor said last and whenever it said it, a job is lost only on its word (a heartbeat sent
    after the placement, heard more than the timeout after the job was last listed) or past its limit."""
    jobs = [job(f"j{i}", placed_at=now - age if now >= age else 0.0, max_runtime_s=age + 1.0, last_heard=h)
            for i, (h, age) in enumerate(heard_at)]
    latest = heard(latest_round[0], sent_at=latest_round[1]) if latest_round is not None else None
    heard_now = max([h for h, _ in heard_at] + [latest.heard_at if latest else 0.0]) + SETTINGS.heartbeat_timeout_s
    for verdict in lost_jobs(jobs, now=now, heard_now=heard_now, settings=SETTINGS, latest=latest):
        lost = next(j for j in jobs if j.job_id == verdict.job_id)
        overran = now - lost.placed_at - lost.max_runtime_s > SETTINGS.runtime_grace_s
        if latest is None or latest.heard_at - lost.last_heard <= SETTINGS.heartbeat_timeout_s:
            assert overran, verdict
        if latest is not None and latest.sent_at < lost.placed_at:
            assert overran, verdict
