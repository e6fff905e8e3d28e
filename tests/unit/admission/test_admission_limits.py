"""Per-team limits at submit (core/limits.py): a token bucket on admission's clock, deterministic for the same
times, and a cap on each team's waiting jobs that the core's state counts in O(1)."""

from __future__ import annotations

import pytest

from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.admission.limits import RATE_LIMITED, TOO_MANY_PENDING, Bucket, pending_refusal, rate_refusal, take
from shared.config import TeamPolicy, parse_queues
from tests.unit.admission.admission_core_builders import H100, config, job, queue


def test_a_bucket_starts_full_refills_at_its_rate_and_never_past_its_burst() -> None:
    bucket, wait = take(None, 100.0, rate_per_s=2.0, burst=3)
    assert (bucket, wait) == (Bucket(2.0, 100.0), None)
    bucket, _ = take(bucket, 100.0, 2.0, 3)
    bucket, _ = take(bucket, 100.0, 2.0, 3)
    assert bucket.tokens == 0.0
    bucket, wait = take(bucket, 100.25, 2.0, 3)  # half a token so far
    assert bucket == Bucket(0.5, 100.25) and wait == pytest.approx(0.25)
    bucket, wait = take(bucket, 100.5, 2.0, 3)
    assert wait is None and bucket.tokens == pytest.approx(0.0)
    bucket, wait = take(bucket, 10_000.0, 2.0, 3)  # a long quiet spell refills to the burst, no more
    assert wait is None and bucket.tokens == 2.0
    bucket, wait = take(Bucket(0.0, 50.0), 40.0, 2.0, 3)  # a clock that went back refills nothing
    assert bucket == Bucket(0.0, 50.0) and wait == pytest.approx(0.5)


def test_the_same_submissions_at_the_same_times_get_the_same_verdicts() -> None:
    policy = TeamPolicy(submit_rate_per_s=1.0, submit_burst=2)
    times = [0.0, 0.1, 0.2, 0.3, 1.3, 1.4, 5.0]

    def run() -> list[str | None]:
        buckets: dict[str, Bucket] = {}
        return [(v.reason if (v := rate_refusal(buckets, "team-a", f"j{i}", t, policy)) else None)
                for i, t in enumerate(times)]

    assert run() == run() == [None, None, RATE_LIMITED, RATE_LIMITED, None, RATE_LIMITED, None]


def test_a_refusal_says_the_limit_and_when_to_retry_and_other_teams_are_not_charged() -> None:
    policy = TeamPolicy(submit_rate_per_s=0.5, submit_burst=1)
    buckets: dict[str, Bucket] = {}
    assert rate_refusal(buckets, "team-a", "a1", 0.0, policy) is None
    refused = rate_refusal(buckets, "team-a", "a2", 0.0, policy)
    assert refused is not None and refused.reason == RATE_LIMITED
    assert "team team-a" in refused.message and "0.5 per second" in refused.message
    assert "again in 2.0 s" in refused.message
    assert rate_refusal(buckets, "team-b", "b1", 0.0, policy) is None  # team-b's own bucket
    assert rate_refusal(buckets, "team-a", "a3", 0.0, TeamPolicy(submit_rate_per_s=None)) is None  # no limit


def test_the_pending_cap_counts_the_teams_waiting_jobs() -> None:
    policy = TeamPolicy(max_pending_jobs=2)
    assert pending_refusal("team-a", "j", 1, policy) is None
    refused = pending_refusal("team-a", "j", 2, policy)
    assert refused is not None and refused.reason == TOO_MANY_PENDING
    assert "already has 2 jobs waiting, at most 2" in refused.message
    assert pending_refusal("team-a", "j", 10**6, TeamPolicy(max_pending_jobs=None)) is None


def test_defaults_are_on_and_configurable_per_team_in_queues_yaml() -> None:
    default = TeamPolicy()
    assert (default.submit_rate_per_s, default.submit_burst, default.max_pending_jobs) == (100.0, 20_000, 20_000)
    cfg = parse_queues({"priority_classes": [{"name": "normal", "value": 1}],
                        "queues": [{"name": "q", "quotas": {"H100": {"nominal": 1}}}],
                        "governance": {"teams": {"team-a": {"submit_rate_per_s": 2, "submit_burst": 10,
                                                            "max_pending_jobs": None}}}}, "test")
    policy = cfg.governance.for_team("team-a")
    assert (policy.submit_rate_per_s, policy.submit_burst, policy.max_pending_jobs) == (2.0, 10, None)
    with pytest.raises(ValueError, match="submit_rate_per_s"):
        TeamPolicy.model_validate({"submit_rate_per_s": float("inf")})


def test_the_state_counts_each_teams_waiting_jobs_as_they_come_and_go() -> None:
    s = AdmissionState(config(queue("q", {H100: 1})))
    for job_id, team in (("a1", "team-a"), ("a2", "team-a"), ("b1", "team-b")):
        assert s.submit(Workload(job(job_id, "q", gpus=1, team=team), 0)) is None
    assert (s.pending_of("team-a"), s.pending_of("team-b"), s.pending_of("team-c")) == (2, 1, 0)
    s.finish("a2")
    assert s.pending_of("team-a") == 1
    s.finish("a2")  # idempotent
    assert s.pending_of("team-a") == 1
    copied = s.copy()
    s.finish("b1")
    assert (s.pending_of("team-b"), copied.pending_of("team-b")) == (0, 1)
    assert admission_cycle(s, now=1.0).admitted  # a1 admitted: it no longer waits
    assert "a1" in s.admitted and s.pending_of("team-a") == 0
