"""Retry of failed attempts: the one rule every executor (and anything else that observes a failure) applies.

A job's `RetryPolicy` (shared.domain) says which exit reasons are retried, how many times (`backoff_limit`,
Kubernetes' Job `backoffLimit`) and after what backoff (`backoff_s` doubled per retry, capped at
`max_backoff_s`, as the Job controller backs off pod failures). `decide_retry` turns "attempt n failed with
reason r" into either a retry (not before `not_before`) or the final failure, with the message users read.

Pure: no clock (the failure time is an argument), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.domain import RetryPolicy


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    attempt: int  # the attempt that failed, 1-based
    attempts_allowed: int  # 1 + backoff_limit
    delay_s: float  # wait before the next attempt (0 when not retried)
    not_before: float | None  # failed_at + delay_s when retried
    message: str  # the failure's message, completed with what happens next


def retry_delay_s(policy: RetryPolicy, retry: int) -> float:
    """The wait before the `retry`-th retry (1-based): backoff_s * 2^(retry-1), at most max_backoff_s."""
    if retry < 1:
        raise ValueError(f"retry number must be at least 1, got {retry}")
    # 2**exponent grows without bound: cap the exponent first (2^60 s is far past any cap a policy may set)
    return min(policy.max_backoff_s, policy.backoff_s * float(2 ** min(retry - 1, 60)))


def decide_retry(policy: RetryPolicy | None, attempt: int, reason: str, message: str,
                 failed_at: float) -> RetryDecision:
    """What follows the failure of attempt `attempt` (1-based) with exit reason `reason`."""
    if attempt < 1:
        raise ValueError(f"attempt must be at least 1, got {attempt}")
    if policy is None or policy.backoff_limit == 0:
        return RetryDecision(False, attempt, 1 + (policy.backoff_limit if policy else 0), 0.0, None,
                             _final(message, attempt))
    allowed = 1 + policy.backoff_limit
    if reason not in policy.reasons:
        why = f"{reason} is not retried (retry.reasons: {', '.join(policy.reasons)})"
        return RetryDecision(False, attempt, allowed, 0.0, None, _final(message, attempt, why))
    if attempt >= allowed:
        return RetryDecision(False, attempt, allowed, 0.0, None,
                             _final(message, attempt, f"backoff_limit {policy.backoff_limit} reached"))
    delay = retry_delay_s(policy, attempt)
    text = f"{message}; attempt {attempt} of {allowed} failed, retrying after {delay:g} s"
    return RetryDecision(True, attempt, allowed, delay, failed_at + delay, text.lstrip("; "))


def _final(message: str, attempt: int, why: str | None = None) -> str:
    if attempt == 1 and why is None:
        return message  # no retry policy: the message as it always was
    parts = [message] if message else []
    parts.append(f"failed after {attempt} attempt{'s' if attempt != 1 else ''}" + (f" ({why})" if why else ""))
    return "; ".join(parts)
