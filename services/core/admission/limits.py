"""Per-team limits at submit: how fast a team may submit (a token bucket) and how many of its jobs may wait at once.

Pure: the caller passes the time (admission's clock at receipt) and the team's count of waiting jobs; the same
submissions at the same times give the same verdicts. The limits are the team's governance policy
(`queues.yaml` `governance`: `submit_rate_per_s`, `submit_burst`, `max_pending_jobs`). A refusal is a
`Violation` whose reason (`RateLimited`, `TooManyPending`) and message tell the submitter what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.core.admission.governance import Violation
from shared.config import TeamPolicy

RATE_LIMITED = "RateLimited"
TOO_MANY_PENDING = "TooManyPending"


@dataclass(frozen=True)
class Bucket:
    """A team's submission tokens as of `at` (the admission clock, seconds)."""

    tokens: float
    at: float


def take(bucket: Bucket | None, now: float, rate_per_s: float, burst: int) -> tuple[Bucket, float | None]:
    """Take one submission's token: (the bucket afterwards, None) when there was one, else (the bucket, seconds
    until the next token). A new team starts full; a clock that went back refills nothing (never a negative
    refill, never more than `burst`)."""
    if bucket is None:
        tokens, at = float(burst), now
    else:
        elapsed = max(0.0, now - bucket.at)
        tokens, at = min(float(burst), bucket.tokens + elapsed * rate_per_s), max(now, bucket.at)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, at), None
    return Bucket(tokens, at), (1.0 - tokens) / rate_per_s


def rate_refusal(buckets: dict[str, Bucket], team: str, job_id: str, now: float,
                 policy: TeamPolicy) -> Violation | None:
    """Charge one submission to `team`'s bucket in `buckets` (updated in place); a Violation when it has no token."""
    if policy.submit_rate_per_s is None:
        return None
    bucket, wait_s = take(buckets.get(team), now, policy.submit_rate_per_s, policy.submit_burst)
    buckets[team] = bucket
    if wait_s is None:
        return None
    return Violation(RATE_LIMITED, f"job {job_id}: team {team} submits faster than its limit of "
                                   f"{policy.submit_rate_per_s:g} per second (bursts of {policy.submit_burst}); "
                                   f"not queued: submit it again in {wait_s:.1f} s or later")


def pending_refusal(team: str, job_id: str, waiting: int, policy: TeamPolicy) -> Violation | None:
    """A Violation when `team` already has `waiting` jobs waiting (in its queues or for approval), its cap."""
    cap = policy.max_pending_jobs
    if cap is None or waiting < cap:
        return None
    return Violation(TOO_MANY_PENDING, f"job {job_id}: team {team} already has {waiting} jobs waiting, at most "
                                       f"{cap}; not queued: submit it again when some have been admitted, or cancel "
                                       "some")
