"""The liveness rule: silent for longer than the timeout, or placed past the runtime limit plus grace, is lost."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.core.liveness import LivenessSettings, WatchedJob, lost_jobs

SETTINGS = LivenessSettings(heartbeat_timeout_s=60.0, runtime_grace_s=300.0)


def job(job_id: str, *, placed_at: float = 0.0, max_runtime_s: float = 3600.0, last_heard: float = 0.0) -> WatchedJob:
    return WatchedJob(job_id=job_id, placed_at=placed_at, max_runtime_s=max_runtime_s, last_heard=last_heard)


def test_silent_jobs_and_overrunning_jobs_are_lost_others_are_not() -> None:
    jobs = [job("heard", last_heard=100.0), job("silent", last_heard=30.0),
            job("overran", placed_at=0.0, max_runtime_s=1000.0, last_heard=100.0),
            job("in-grace", placed_at=0.0, max_runtime_s=1002.0, last_heard=100.0)]
    lost = lost_jobs(jobs, now=1301.0, heard_now=100.0, settings=SETTINGS)
    assert [v.job_id for v in lost] == ["overran", "silent"]  # sorted by id: a deterministic order
    assert "no executor heartbeat" in lost[1].message and "70 s" in lost[1].message
    assert "past max_runtime_s=1000" in lost[0].message


def test_exactly_at_the_timeout_is_not_yet_lost() -> None:
    assert lost_jobs([job("a", last_heard=0.0)], now=0.0, heard_now=60.0, settings=SETTINGS) == []
    assert lost_jobs([job("a", max_runtime_s=10.0)], now=310.0, heard_now=0.0, settings=SETTINGS) == []


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        LivenessSettings(heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="runtime_grace_s"):
        LivenessSettings(runtime_grace_s=-1)


@given(st.lists(st.tuples(st.floats(0, 1e5), st.floats(0, 1e5)), max_size=20), st.floats(0, 2e5))
def test_a_job_heard_within_the_timeout_and_inside_its_limit_is_never_lost(
        heard: list[tuple[float, float]], now: float) -> None:
    jobs = [job(f"j{i}", placed_at=now - age if now >= age else 0.0, max_runtime_s=age + 1.0, last_heard=h)
            for i, (h, age) in enumerate(heard)]
    heard_now = max((h for h, _ in heard), default=0.0) + SETTINGS.heartbeat_timeout_s
    for verdict in lost_jobs(jobs, now=now, heard_now=heard_now, settings=SETTINGS):
        silent = next(j for j in jobs if j.job_id == verdict.job_id)
        assert heard_now - silent.last_heard > SETTINGS.heartbeat_timeout_s or \
            now - silent.placed_at - silent.max_runtime_s > SETTINGS.runtime_grace_s
