"""Injected clocks: pure cores take `now` as an argument; services read it from one of these."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock tests (and the simulator) move by hand."""

    def __init__(self, start: float = 1_700_000_000.0):
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        self._t += seconds

    def set(self, t: float) -> None:
        self._t = t


class ScaledClock:
    """Wall time sped up by `factor` from `origin`: the demo's accelerated time."""

    def __init__(self, factor: float, origin: float | None = None):
        self.factor = factor
        self._wall0 = time.time()
        self._origin = origin if origin is not None else self._wall0

    def now(self) -> float:
        return self._origin + (time.time() - self._wall0) * self.factor
