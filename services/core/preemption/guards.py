"""Guard rails: a per-queue preemption rate limit and the no-cascade cool-down.

Rate limit decision: `max_preemptions_per_hour` of a queue caps the victims *its* jobs may take in any
sliding hour. It is charged to the preemptor's queue, not the victim's: a borrower must not be able to
make its borrowed GPUs un-reclaimable by setting its own limit to 0 (that would break guarantees).

Cascade decision: a job preempted at time t cannot be a preemptor before t + cool-down (default: the
protection window). Together with "victims must have strictly lower priority" and "victims in the
protection window are skipped", a preempted job coming back cannot knock out others on its way in.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.config import QueuesConfig

HOUR_S = 3600.0


def rate_limit_verdict(config: QueuesConfig, queue: str, recent_victim_times: Iterable[float], now: float,
                       new_victims: int) -> str | None:
    """A message when taking `new_victims` more would exceed the queue's hourly limit, else None."""
    q = config.queue_map.get(queue)
    if q is None or q.max_preemptions_per_hour is None:
        return None
    used = sum(1 for t in recent_victim_times if now - HOUR_S < t <= now)
    if used + new_victims > q.max_preemptions_per_hour:
        return (f"queue {queue} may preempt {q.max_preemptions_per_hour} jobs per hour; {used} taken in the "
                f"last hour, this request needs {new_victims} more")
    return None


def cooldown_s(config: QueuesConfig) -> float:
    return float(max(config.policy.protection_window_s, 60))


def cooldown_ends(config: QueuesConfig, last_preempted_at: float | None) -> float | None:
    """When a job last preempted at `last_preempted_at` may be a preemptor again (None: it never was one)."""
    return None if last_preempted_at is None else last_preempted_at + cooldown_s(config)


def cooldown_verdict(config: QueuesConfig, last_preempted_at: float | None, now: float) -> str | None:
    """Why a job last preempted at `last_preempted_at` may not preempt others at `now` (None: it may)."""
    until = cooldown_ends(config, last_preempted_at)
    if until is None or now >= until:
        return None
    cooldown = cooldown_s(config)
    return (f"the job was itself preempted {now - (until - cooldown):.0f}s ago; it may preempt others only "
            f"after a {cooldown:.0f}s cool-down (no cascades)")
