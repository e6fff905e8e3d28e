"""What one admission cycle leaves for the next, so that cycles that follow small changes cost O(changed cohorts).

The admission state owns one `CycleMemo` (AdmissionState.cycle_memo): it forgets a scope or a queue whenever
something of it changes, and the cycle (cycle.py, reuse.py) reads and refreshes the rest. Pure data, no I/O.
"""

from __future__ import annotations

from services.core.admission.model import ReclaimRequest
from services.core.admission.ordering import Order
from services.core.admission.resources import Signature


class CycleMemo:
    """The reuse caches of the admission cycle, as the last cycle left them."""

    __slots__ = ("reclaims", "scope_ends", "seal_count", "sealed", "stale")

    def __init__(self) -> None:
        # Per scope (a cohort, or a queue without one), the reclaims of the last full cycle in which nothing
        # was admitted there; the entries' reasons from that cycle are still on them. Valid until something in
        # the scope changes (`stale`). A cycle without `capacity`/`max_admissions` reuses them: cohorts share
        # nothing else, so an unchanged cohort would decide exactly the same again. This makes frequent small
        # cycles cost O(changed cohorts).
        self.reclaims: dict[str, list[ReclaimRequest]] = {}  # scope -> reclaims
        self.stale: set[str] = set()
        # Queues whose pending jobs no change elsewhere in their cohort can affect (held, at max_running_jobs, or
        # no job's request fits within nominal + borrowing limit, and no job could preempt within the queue:
        # reuse.py `queue_alone`), as a cycle that admitted nothing there left them, unchanged since (`touch`).
        # A cycle keeps their reasons instead of judging them again (reuse.py, "sealed queues"); the value holds
        # their lazily written messages, whose numbers (the cohort's) are written again when next read, their
        # distinct requests, and the seal's serial number (`seal_count` when sealed): a queue sealed under the same
        # serial in two cycles has the same pending list in both, as nothing of it changed in between.
        self.sealed: dict[str, tuple[tuple[object, ...], tuple[Signature, ...], int]] = {}
        self.seal_count = 0
        # scope -> per queue with pending jobs, its pending jobs' order keys (or, for a sealed queue, its seal's
        # serial) as the last explaining cycle left them (which positions in the cohort moved)
        self.scope_ends: dict[str, dict[str, list[Order] | int]] = {}

    def touch(self, scope: str, queue: str) -> None:
        """Something of `queue` (in `scope`) changed: its scope's cached cycle and its sealed reasons no longer
        hold."""
        self.stale.add(scope)
        if self.sealed:
            self.sealed.pop(queue, None)

    def forget_decisions(self) -> None:
        """A new configuration: no cached cycle, sealed queue or recorded position holds (staleness is kept: the
        cycle judges every scope again anyway, having no cached cycle)."""
        self.reclaims.clear()
        self.sealed.clear()
        self.scope_ends.clear()
