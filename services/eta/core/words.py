"""An ETA in words, one way for every place a user reads it: `gpuq explain` (and the API's explanation) and the
Kubernetes Event of a Pending job say the same start and the same range."""

from __future__ import annotations

from datetime import UTC, datetime


def when(ts: float) -> str:
    """Epoch seconds as `gpuq explain` writes a time (UTC, to the second)."""
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def eta_words(eta: float | None, low: float | None = None, high: float | None = None) -> str:
    """The expected start: most likely, then the p10-p90 range when admission gave one ("unknown" without)."""
    if eta is None:
        return "unknown"
    text = when(eta)
    if low is not None and high is not None:
        text += f" (likely between {when(low)} and {when(high)})"
    return text
