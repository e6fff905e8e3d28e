"""When a pending job's status is worth a JobPending event.

Every admission in a deep queue moves the position of every job behind it, and every change of a queue's usage
changes the numbers in its waiting jobs' messages: publishing each of those would put thousands of events per
cycle on the bus and in front of webhook subscribers, who want to hear when something they can act on changed.
So an event goes out when the reason changes, when a position moves materially (into the first ten places, or
by at least ten places and a tenth of the old position), or when the message changed and the job has not
heard from us for `message_every_s`. The table row always holds the latest status (`gpuq explain` reads it);
the ETA path has its own threshold. Pure: the caller passes the clock reading.
"""

from __future__ import annotations

from dataclasses import dataclass

TOP_POSITIONS = 10  # near the head every move is news
MESSAGE_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Published:
    reason: str
    message: str
    position_in_queue: int
    position_in_cohort: int
    at: float  # service clock, seconds


def _moved(old: int, new: int) -> bool:
    if old == new:
        return False
    if new <= TOP_POSITIONS or old <= TOP_POSITIONS:
        return True
    return abs(new - old) >= max(TOP_POSITIONS, 0.1 * old)


def worth_publishing(last: Published | None, reason: str, message: str, position_in_queue: int,
                     position_in_cohort: int, now: float, message_every_s: float = MESSAGE_EVERY_S) -> bool:
    """Should this status go out as a JobPending event, given the last one published for the job?"""
    if last is None or last.reason != reason:
        return True
    if _moved(last.position_in_queue, position_in_queue) or _moved(last.position_in_cohort, position_in_cohort):
        return True
    return last.message != message and now - last.at >= message_every_s
