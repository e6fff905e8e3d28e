"""The fake cluster's clock: wall time plus an offset a test can advance (deadlines, grace periods, timestamps)."""

from __future__ import annotations

import datetime as dt
from typing import Any


class FakeClock:
    def __init__(self, start: dt.datetime | None = None) -> None:
        self._start = start
        self._offset = dt.timedelta()

    def now(self) -> dt.datetime:
        base = self._start if self._start is not None else dt.datetime.now(dt.UTC)
        return (base + self._offset).replace(microsecond=0)

    def advance(self, seconds: float) -> None:
        self._offset += dt.timedelta(seconds=seconds)

    def seconds_since(self, stamp: str) -> float:
        return (self.now() - parse_time(stamp)).total_seconds()

    def stamp(self, offset_s: float = 0) -> str:
        """RFC 3339 with second precision, as Kubernetes writes metav1.Time."""
        return format_time(self.now() + dt.timedelta(seconds=offset_s))


def format_time(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> dt.datetime:
    return dt.datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
