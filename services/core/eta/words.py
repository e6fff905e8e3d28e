"""An ETA in words, one way for every place a user reads it: `gpuq explain` (and the API's explanation) and the
Kubernetes Event of a Pending job say the same start and the same range."""

from __future__ import annotations

from shared.timefmt import human_time


def when(ts: float) -> str:
    """Epoch seconds as `gpuq explain` writes a time (to the second, with its zone: shared/timefmt.py)."""
    return human_time(ts)


def eta_words(eta: float | None, low: float | None = None, high: float | None = None) -> str:
    """The expected start: most likely, then the p10-p90 range when admission gave one ("unknown" without). A range
    that reads as one time (both ends the same to the second, or both the start itself) is not repeated: one time."""
    if eta is None:
        return "unknown"
    text = when(eta)
    if low is not None and high is not None:
        first, last = when(min(low, eta)), when(max(high, eta))
        if first != last:
            text += f" (likely between {first} and {last})"
    return text
