"""Retry schedule: exponential backoff with jitter. Pure: the random draw is passed in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 8  # then the delivery is dead-lettered
    base_s: float = 10.0  # delay after the first failed attempt (before jitter)
    factor: float = 3.0
    cap_s: float = 6 * 3600.0
    jitter: float = 0.25  # the delay is scaled by a factor drawn from [1 - jitter, 1 + jitter)

    def delay(self, failed_attempts: int, u: float) -> float:
        """Delay before the next attempt after `failed_attempts` failures; `u` is uniform in [0, 1)."""
        raw = min(self.cap_s, self.base_s * self.factor ** max(0, failed_attempts - 1))
        return raw * (1.0 - self.jitter + 2.0 * self.jitter * u)

    def exhausted(self, attempts: int) -> bool:
        return attempts >= self.max_attempts
