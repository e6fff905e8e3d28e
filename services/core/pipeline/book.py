"""`PlacementBook`: the jobs a scheduler holds between admission and their end, in the forms its cycle reads.

A cycle reads the waiting jobs in the pipeline's order (`placement_key`), the placed jobs' timeline (expected end,
job id; sorted) and the lowest priority among the placed preemptible jobs. Rebuilding those from dictionaries at
every cycle sorted every waiting and every placed job again, a cost per cycle that grew with the cluster and the
backlog whatever the cycle then placed (38% of the scheduler service's time in a 20,000-job burst). The book keeps
them up to date as the events arrive instead: an admission inserts one job into the order, a placement or a start
one entry into the timeline, an end removes one; each a binary search and a list insertion (a memmove, not a
sort). `rebuilt()` says what the rebuild would give, which the tests compare with the book after random events.

Pure: no I/O, no clock; the caller applies its events in order and the book only keeps what they said.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.core.scheduler import PendingJob

from .pipeline import WaitingJob, placement_key


@dataclass(frozen=True)
class BookView:
    """What a cycle reads, however it was obtained (kept by a book, or rebuilt from its dictionaries)."""

    pending: tuple[PendingJob, ...]  # the waiting jobs in placement order
    timeline: tuple[tuple[float, str], ...]  # the placed jobs' (expected end, job id), sorted
    lowest_preemptible: int | None


class PlacementBook:
    def __init__(self) -> None:
        self._waiting: dict[str, WaitingJob] = {}
        # The waiting jobs' placement keys, sorted, and their PendingJobs in the same order: schedule_cycle reads
        # the latter as it is (a PendingJob is made once per admission, not once per cycle).
        self._keys: list[tuple[int, float, str]] = []
        self._pending: list[PendingJob] = []
        self._placed: dict[str, tuple[float, int | None]] = {}  # job -> (expected end, priority if preemptible)
        self._timeline: list[tuple[float, str]] = []
        # priority -> how many placed preemptible jobs have it: the lowest is read every cycle, and a scan of every
        # placed job per cycle grew with the cluster (priorities are few)
        self._preemptible: dict[int, int] = {}

    # ------------------------------------------------------------------ waiting jobs

    @property
    def waiting(self) -> Mapping[str, WaitingJob]:
        return self._waiting

    @property
    def pending(self) -> Sequence[PendingJob]:
        """The waiting jobs in placement order (`placement_key`). The book's own list: read it, do not keep it
        across a change of the book."""
        return self._pending

    def wait(self, job: WaitingJob) -> None:
        """`job` waits for placement (again: a re-admission replaces its earlier entry)."""
        self.unwait(job.job_id)
        key = placement_key(job)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._pending.insert(i, PendingJob(spec=job.spec, allowed_models=job.allowed_models))
        self._waiting[job.job_id] = job

    def unwait(self, job_id: str) -> WaitingJob | None:
        """`job_id` no longer waits (placed, finished or cancelled); what it was, or None if it did not wait."""
        job = self._waiting.pop(job_id, None)
        if job is not None:
            i = bisect.bisect_left(self._keys, placement_key(job))
            assert self._keys[i][2] == job_id, f"{job_id} missing from the waiting order"
            del self._keys[i]
            del self._pending[i]
        return job

    def priority(self, job_id: str) -> int:
        return self._waiting[job_id].priority

    # ------------------------------------------------------------------ placed jobs

    @property
    def placed(self) -> Mapping[str, tuple[float, int | None]]:
        """job -> (expected end, its priority if preemption may stop it, else None)."""
        return self._placed

    @property
    def timeline(self) -> Sequence[tuple[float, str]]:
        """The placed jobs' (expected end, job id), sorted. The book's own list, like `pending`."""
        return self._timeline

    @property
    def lowest_preemptible(self) -> int | None:
        return min(self._preemptible) if self._preemptible else None

    def add_placed(self, job_id: str, expected_end: float, preemptible_priority: int | None) -> None:
        """`job_id` is placed (again: replaces its earlier entry), expected to end at `expected_end`."""
        self.end(job_id)
        self._placed[job_id] = (expected_end, preemptible_priority)
        bisect.insort(self._timeline, (expected_end, job_id))
        if preemptible_priority is not None:
            self._preemptible[preemptible_priority] = self._preemptible.get(preemptible_priority, 0) + 1

    def move_end(self, job_id: str, expected_end: float) -> None:
        """A placed job's expected end moved (its real start is known); nothing for a job not placed."""
        found = self._placed.get(job_id)
        if found is None or found[0] == expected_end:
            return
        self._drop_end(found[0], job_id)
        self._placed[job_id] = (expected_end, found[1])
        bisect.insort(self._timeline, (expected_end, job_id))

    def end(self, job_id: str) -> None:
        """`job_id` is no longer placed (finished, failed, preempted, cancelled); nothing if it was not."""
        found = self._placed.pop(job_id, None)
        if found is None:
            return
        self._drop_end(found[0], job_id)
        if found[1] is not None:
            left = self._preemptible[found[1]] - 1
            if left:
                self._preemptible[found[1]] = left
            else:
                del self._preemptible[found[1]]

    def _drop_end(self, expected_end: float, job_id: str) -> None:
        entry = (expected_end, job_id)
        i = bisect.bisect_left(self._timeline, entry)
        assert self._timeline[i] == entry, f"{job_id} missing from the running timeline"
        del self._timeline[i]

    # ------------------------------------------------------------------ all of it

    def forget(self, job_id: str) -> None:
        """The job ended: neither waiting nor placed."""
        self.unwait(job_id)
        self.end(job_id)

    def clear(self) -> None:
        for part in (self._waiting, self._placed, self._preemptible):
            part.clear()
        for seq in (self._keys, self._pending, self._timeline):
            seq.clear()

    def view(self) -> BookView:
        return BookView(tuple(self._pending), tuple(self._timeline), self.lowest_preemptible)

    def rebuilt(self) -> BookView:
        """What a cycle read before the book kept it: everything sorted again from the dictionaries."""
        order = sorted(self._waiting.values(), key=placement_key)
        return BookView(tuple(PendingJob(spec=w.spec, allowed_models=w.allowed_models) for w in order),
                        tuple(sorted((end, job_id) for job_id, (end, _) in self._placed.items())),
                        min((p for _, p in self._placed.values() if p is not None), default=None))
