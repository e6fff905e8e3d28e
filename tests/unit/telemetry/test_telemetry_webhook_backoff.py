"""Retry delays grow exponentially, stay within the jitter band and the cap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.telemetry.webhooks.backoff import RetryPolicy


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
