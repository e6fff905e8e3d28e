"""Times in the words every server-produced message uses: a date, a time to the second and the zone.

An epoch in a message ("reserved to start at t=1796501625") says nothing to its reader, and a time without a zone
says the wrong thing to one who is not in UTC. Pure (no clock is read): the callers give the instant, so the pure
cores (the scheduler's reasons, the ETA's words) format with it too.
"""

from __future__ import annotations

from datetime import UTC, datetime

FORMAT = "%Y-%m-%d %H:%M:%S UTC"


def human_time(ts: float | datetime) -> str:
    """`ts` (epoch seconds, or an aware datetime) as "2026-12-05 23:48:26 UTC"."""
    at = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, tz=UTC)
    return at.astimezone(UTC).strftime(FORMAT)
