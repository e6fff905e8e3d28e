"""The retry rule every executor applies (services/core/pipeline/retry.py) and the policy's validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from services.core.pipeline import decide_retry, retry_delay_s
from shared.domain import DEFAULT_RETRY_ON, JobSpec, PodSet, RetryPolicy
from shared.events import ExitReason


def test_a_job_with_backoff_limit_2_is_retried_after_its_backoff_when_its_first_attempt_fails_with_error() -> None:
    policy = RetryPolicy(backoff_limit=2, backoff_s=30, max_backoff_s=600)
    first = decide_retry(policy, 1, "Error", "exit code 1", failed_at=1000.0)
    assert first.retry and first.attempts_allowed == 3
    assert first.not_before == 1030.0 and first.delay_s == 30.0
    second = decide_retry(policy, 2, "Error", "exit code 1", failed_at=2000.0)
    assert second.retry and second.not_before == 2060.0  # doubled


def test_after_backoff_limit_failures_the_job_fails_with_the_number_of_attempts() -> None:
    policy = RetryPolicy(backoff_limit=2)
    last = decide_retry(policy, 3, "Error", "exit code 1", failed_at=0.0)
    assert not last.retry and last.not_before is None
    assert "after 3 attempts" in last.message and "backoff_limit 2 reached" in last.message
    assert last.message.startswith("exit code 1")


def test_oomkilled_is_not_retried_by_default() -> None:
    decision = decide_retry(RetryPolicy(backoff_limit=5), 1, "OOMKilled", "killed", failed_at=0.0)
    assert not decision.retry
    assert "OOMKilled is not retried" in decision.message
    # ...unless the policy names it
    assert decide_retry(RetryPolicy(backoff_limit=5, reasons=("OOMKilled",)), 1, "OOMKilled", "", 0.0).retry


def test_the_default_rule_retries_what_a_retry_can_cure() -> None:
    assert set(DEFAULT_RETRY_ON) == {"Error", "NodeFailure", "Evicted"}
    policy = RetryPolicy(backoff_limit=1)
    for reason in ExitReason:
        assert decide_retry(policy, 1, reason.value, "", 0.0).retry == (reason.value in DEFAULT_RETRY_ON)


def test_no_policy_or_a_zero_limit_keeps_todays_final_failure_and_message() -> None:
    for policy in (None, RetryPolicy()):
        d = decide_retry(policy, 1, "Error", "simulated Error", failed_at=5.0)
        assert not d.retry and d.message == "simulated Error"


@given(base=st.floats(0, 1000), cap_extra=st.floats(0, 10_000), n=st.integers(1, 200))
def test_backoff_grows_and_never_passes_its_cap(base: float, cap_extra: float, n: int) -> None:
    policy = RetryPolicy(backoff_limit=100, backoff_s=base, max_backoff_s=base + cap_extra)
    d = retry_delay_s(policy, n)
    assert base <= d <= policy.max_backoff_s
    assert retry_delay_s(policy, n + 1) >= d


def test_bad_policies_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValidationError, match="unknown exit reason"):
        RetryPolicy(backoff_limit=1, reasons=("Segfault",))
    with pytest.raises(ValidationError, match="cannot name Cancelled"):
        RetryPolicy(backoff_limit=1, reasons=("Cancelled",))
    with pytest.raises(ValidationError, match="backoff_limit"):
        RetryPolicy(backoff_limit=-1)
    with pytest.raises(ValidationError, match="cap must be at least the first backoff"):
        RetryPolicy(backoff_limit=1, backoff_s=60, max_backoff_s=10)
    with pytest.raises(ValueError, match="attempt must be at least 1"):
        decide_retry(RetryPolicy(backoff_limit=1), 0, "Error", "", 0.0)


def test_a_job_spec_takes_a_retry_policy_and_old_specs_have_none() -> None:
    spec = JobSpec.model_validate({"job_id": "j", "team": "t", "queue": "q", "pod_sets": [{"count": 1}],
                                   "retry": {"backoff_limit": 2, "reasons": ["NodeFailure", "Error"]}})
    assert spec.retry is not None and spec.retry.reasons == ("Error", "NodeFailure")
    assert JobSpec(job_id="j", team="t", queue="q", pod_sets=(PodSet(),)).retry is None


def test_the_retryable_reasons_are_exit_reasons() -> None:
    from shared.domain import NEVER_RETRIED, RETRYABLE_REASONS

    assert set(RETRYABLE_REASONS) | set(NEVER_RETRIED) == {r.value for r in ExitReason}


def test_the_example_job_spec_loads_with_its_retry_policy() -> None:
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[3] / "deploy" / "examples" / "job.yaml").read_text())
    spec = JobSpec.model_validate(doc)
    assert spec.retry is not None and spec.retry.backoff_limit == 3
