"""What an admission instance holds in memory besides its tables: the core's state and the shell's mirrors of what it
last wrote or sent. One object, shared by the service's parts (intake, lifecycle, statuses, ETAs), so that a rebuild
after a failed unit of work (`AdmissionService._rebuild`) replaces or clears all of it in one place and no part keeps
a stale copy of the state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from services.admission.publish import Published
from services.core.admission import AdmissionState
from shared.config import QueuesConfig
from shared.service import Tx


@dataclass
class Memory:
    state: AdmissionState
    # this instance's placed jobs -> placed_at (then started_at) + max_runtime_s, from their JobPlaced/JobStarted
    expected_end: dict[str, float] = field(default_factory=dict)
    # Jobs waiting out a retry backoff (pending, held outside the queue) -> when they may be admitted again.
    backoff: dict[str, float] = field(default_factory=dict)
    # the status last written to the table, and when (reason, message, positions, service clock)
    published: dict[str, tuple[str, str, int, int, float]] = field(default_factory=dict)
    announced: dict[str, Published] = field(default_factory=dict)  # the status last sent as JobPending (publish.py)
    etas: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # job -> (start, p10, p90) published
    reclaims_sent: set[str] = field(default_factory=set)  # preemptors whose PreemptionRequested went out
    version: int = 0  # bumped by every handled event; the ETA loop recomputes only when it moved

    @classmethod
    def of(cls, config: QueuesConfig) -> Memory:
        return cls(AdmissionState(config))

    def changed(self) -> None:
        self.version += 1

    def forget_published(self, job_ids: Iterable[str]) -> None:
        """The statuses and ETAs published for these jobs no longer hold (admitted, ended, or back from a failed
        attempt): the next cycle or refresh publishes theirs afresh."""
        for job_id in job_ids:
            for cache in (self.published, self.announced, self.etas):
                cache.pop(job_id, None)

    def keep_published_of(self, held: set[str]) -> None:
        """Forget the published statuses and ETAs of every job but `held` (jobs another instance now owns)."""
        for cache in (self.published, self.announced, self.etas):
            for job_id in [j for j in cache if j not in held]:
                del cache[job_id]

    def clear_published(self) -> None:
        self.published.clear()
        self.announced.clear()
        self.etas.clear()


# A handler's change, applied before the unit of work's admission cycle (AdmissionService._then_cycle).
Body = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class UnitOfWork:
    """How the service's parts take part in a unit of work (services/admission/app.py): `then_cycle` applies an
    event's change and runs an admission cycle after it (or once after the batch); `cycle_and_count` runs that cycle
    now; `may_hold` says whether row writes may be held for the batch's end (held.py)."""

    then_cycle: Callable[[Tx, Body], Awaitable[None]]
    cycle_and_count: Callable[[Tx], Awaitable[None]]
    may_hold: Callable[[Tx], bool]
