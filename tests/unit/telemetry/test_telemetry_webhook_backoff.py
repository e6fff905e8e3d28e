"""Retry delays grow exponentially, stay within the jitter band and the cap, span over a day, honour Retry-After."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.telemetry.webhooks.backoff import (
    ENV_CAP_S,
    ENV_MAX_ATTEMPTS,
    ENV_TIMEOUT_S,
    RetryPolicy,
    RetrySettingsError,
    retry_after_s,
    timeout_from_env,
)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 30), u=st.floats(0, 1, exclude_max=True))
def test_delay_within_jitter_band_and_cap(n: int, u: float) -> None:
    p = RetryPolicy(base_s=10, factor=3, cap_s=3600, jitter=0.25)
    raw = min(3600.0, 10 * 3 ** (n - 1))
    d = p.delay(n, u)
    assert 0.75 * raw <= d < 1.25 * raw + 1e-9


def test_delays_grow_and_attempts_run_out() -> None:
    p = RetryPolicy(max_attempts=4, base_s=1, factor=2, cap_s=100, jitter=0.0)
    assert [p.delay(n, 0.5) for n in (1, 2, 3, 4)] == [1, 2, 4, 8]
    assert not p.exhausted(3) and p.exhausted(4)
    # Jitter spreads retries of many deliveries that failed together.
    j = RetryPolicy(jitter=0.25)
    assert j.delay(2, 0.0) < j.delay(2, 0.99)


def test_the_default_schedule_spans_more_than_a_day_and_is_configurable() -> None:
    default = RetryPolicy()
    assert 24 * 3600 <= default.span_s() <= 3 * 24 * 3600
    assert RetryPolicy.from_env({}) == default
    longer = RetryPolicy.from_env({ENV_MAX_ATTEMPTS: "16", ENV_CAP_S: "43200"})
    assert longer.max_attempts == 16 and longer.cap_s == 43200 and longer.span_s() > 3 * 24 * 3600
    with pytest.raises(RetrySettingsError, match=ENV_MAX_ATTEMPTS):
        RetryPolicy.from_env({ENV_MAX_ATTEMPTS: "lots"})
    with pytest.raises(RetrySettingsError, match="cap_s >= base_s"):
        RetryPolicy.from_env({ENV_CAP_S: "1"})


def test_timeouts_are_15_to_30_seconds() -> None:
    assert timeout_from_env({}) == 20.0
    assert timeout_from_env({ENV_TIMEOUT_S: "30"}) == 30.0
    for bad in ("5", "60"):
        with pytest.raises(RetrySettingsError, match="15-30 s"):
            timeout_from_env({ENV_TIMEOUT_S: bad})


def test_retry_after_is_read_in_both_forms_and_never_retried_before() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()
    assert retry_after_s("120", now) == 120.0
    assert retry_after_s("Mon, 30 Nov 2026 12:05:00 GMT", now) == 300.0
    assert retry_after_s("Mon, 30 Nov 2026 11:00:00 GMT", now) == 0.0
    for junk in (None, "", "soon", "-5"):
        assert retry_after_s(junk, now) is None
    p = RetryPolicy(base_s=10, factor=3, cap_s=3600, jitter=0.25)
    assert p.delay_after(1, 0.5, 120.0) == 120.0  # later than the 10 s backoff
    assert p.delay_after(3, 0.5, 5.0) == p.delay(3, 0.5)  # the backoff is later than Retry-After
    assert p.delay_after(1, 0.5, 10 * 24 * 3600.0) == 3600.0  # a receiver cannot park a delivery for ever
