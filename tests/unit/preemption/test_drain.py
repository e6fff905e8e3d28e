"""Draining a HoldAndDrain queue (services/core/preemption/drain.py): preemptible running jobs of the queue are
evicted; production and non-preemptible ones never; protected ones when their window ends; other queues never."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.preemption import RunningJob, Why, drain_plan
from shared.domain import JobKind


def running(job_id: str, queue: str = "team-a", *, started_at: float = 0.0, preemptible: bool = True,
            production: bool = False, max_runtime_s: int = 100_000) -> RunningJob:
    return RunningJob(job_id=job_id, queue=queue, priority_class="x", priority=0, preemptible=preemptible,
                      production=production, kind=JobKind.TRAINING, gpus=1, usage={"H100": 1},
                      started_at=started_at, max_runtime_s=max_runtime_s)


def test_drain_takes_the_preemptible_jobs_of_the_queue_only() -> None:
    jobs = [running("b", started_at=0), running("a", started_at=0), running("prod", production=True),
            running("pinned", preemptible=False), running("young", started_at=9_900), running("other", "team-b"),
            running("busy")]
    plan = drain_plan("team-a", jobs, now=10_000, protection_window_s=600, busy={"busy"})
    assert plan.victims == ("a", "b")
    assert plan.kept == {"prod": Why.PRODUCTION, "pinned": Why.NOT_PREEMPTIBLE, "young": Why.JUST_STARTED,
                         "busy": Why.BEING_PREEMPTED}
    assert plan.retry_at == 10_500  # when "young" leaves its protection window


@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.floats(min_value=0, max_value=20_000),
                          st.sampled_from(["team-a", "team-b"])), max_size=12),
       st.integers(min_value=0, max_value=3_600))
@settings(max_examples=200)
def test_production_is_never_drained(flags: list[tuple[bool, bool, float, str]], window: int) -> None:
    jobs = [running(f"j{i}", queue, started_at=start, preemptible=pre, production=prod)
            for i, (pre, prod, start, queue) in enumerate(flags)]
    plan = drain_plan("team-a", jobs, now=20_000, protection_window_s=window)
    by_id = {j.job_id: j for j in jobs}
    for victim in plan.victims:
        job = by_id[victim]
        assert job.queue == "team-a" and job.preemptible and not job.production
        assert not (20_000 - job.started_at < window)  # never inside its protection window
    assert set(plan.victims).isdisjoint(plan.kept)
    assert set(plan.victims) | set(plan.kept) == {j.job_id for j in jobs if j.queue == "team-a"}
