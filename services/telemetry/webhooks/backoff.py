"""When to try a webhook delivery again. Pure: the random draw and the clock reading are passed in.

Standard Webhooks' advice, followed here: retry with exponential backoff and jitter over about a day or more
(the default schedule spans about 27 hours over 12 attempts), give each attempt a 15-30 s timeout, throttle
when the receiver answers 429, 502, 503 or 504 and never retry before its `Retry-After`, and stop sending to an
endpoint that answers 410 Gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from shared.settings import Settings, settings

DEFAULT_TIMEOUT_S = 20.0
TIMEOUT_RANGE_S = (15.0, 30.0)
# The receiver is there but asks us to slow down (or a gateway in front of it could not reach it in time).
THROTTLING = frozenset({429, 502, 503, 504})
GONE = 410

ENV_MAX_ATTEMPTS = "GPUQ_WEBHOOK_MAX_ATTEMPTS"
ENV_BASE_S = "GPUQ_WEBHOOK_RETRY_BASE_S"
ENV_CAP_S = "GPUQ_WEBHOOK_RETRY_CAP_S"
ENV_TIMEOUT_S = "GPUQ_WEBHOOK_TIMEOUT_S"


class RetrySettingsError(ValueError):
    pass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 12  # then the delivery is dead-lettered
    base_s: float = 10.0  # delay after the first failed attempt (before jitter)
    factor: float = 3.0
    cap_s: float = 6 * 3600.0  # no single wait is longer (a Retry-After is capped by it too)
    jitter: float = 0.25  # the delay is scaled by a factor drawn from [1 - jitter, 1 + jitter)

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_s <= 0 or self.factor < 1 or self.cap_s < self.base_s \
                or not 0 <= self.jitter < 1:
            raise RetrySettingsError(f"invalid webhook retry policy {self}: need max_attempts >= 1, base_s > 0, "
                                     "factor >= 1, cap_s >= base_s and 0 <= jitter < 1")

    def nominal_delay(self, failed_attempts: int) -> float:
        return min(self.cap_s, self.base_s * self.factor ** max(0, failed_attempts - 1))

    def delay(self, failed_attempts: int, u: float) -> float:
        """Delay before the next attempt after `failed_attempts` failures; `u` is uniform in [0, 1)."""
        return self.nominal_delay(failed_attempts) * (1.0 - self.jitter + 2.0 * self.jitter * u)

    def delay_after(self, failed_attempts: int, u: float, retry_after_s: float | None) -> float:
        """The backoff delay, but never before the receiver's `Retry-After` (itself capped at `cap_s`, so that a
        receiver cannot park a delivery for ever)."""
        backoff = self.delay(failed_attempts, u)
        if retry_after_s is None:
            return backoff
        return max(backoff, min(retry_after_s, self.cap_s))

    def exhausted(self, attempts: int) -> bool:
        return attempts >= self.max_attempts

    def span_s(self) -> float:
        """How long a delivery is retried, first attempt to last, without jitter."""
        return sum(self.nominal_delay(n) for n in range(1, self.max_attempts))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RetryPolicy:
        """The default policy, with GPUQ_WEBHOOK_MAX_ATTEMPTS / _RETRY_BASE_S / _RETRY_CAP_S when set."""
        given = _settings(env)
        default = cls()
        return cls(max_attempts=int(given.webhook_max_attempts), base_s=given.webhook_retry_base_s,
                   factor=default.factor, cap_s=given.webhook_retry_cap_s, jitter=default.jitter)


def timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """Each attempt's timeout: GPUQ_WEBHOOK_TIMEOUT_S (15-30 s, Standard Webhooks' advice), default 20 s."""
    value = _settings(env).webhook_timeout_s
    low, high = TIMEOUT_RANGE_S
    if not low <= value <= high:
        raise RetrySettingsError(f"{ENV_TIMEOUT_S}={value:g}: a webhook timeout must be {low:g}-{high:g} s")
    return value


def _settings(env: Mapping[str, str] | None) -> Settings:
    try:
        return settings(env)
    except RetrySettingsError:
        raise
    except ValueError as exc:  # the webhook variables' errors have always been RetrySettingsErrors
        raise RetrySettingsError(str(exc)) from None


def retry_after_s(value: str | None, now: float) -> float | None:
    """Seconds to wait from a `Retry-After` header (delta-seconds or an HTTP-date, RFC 9110), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        return None
    return max(0.0, when.timestamp() - now)
