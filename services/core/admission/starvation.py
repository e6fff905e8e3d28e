"""No starvation: a bound on how long a job waits while its queue is under its guarantee.

Under BestEffortFIFO a job that does not fit yet (a gang larger than the quota its queue has free) is passed by
every later job of its queue that fits: as long as small jobs keep coming, each freed GPU goes to one of them
and the gang waits for ever, although its queue is within its guaranteed quota. The rule:

    a pending job has *starved* once it waited  max(K × median wait of its class, floor)
    (K = policy.starvation_factor, floor = policy.starvation_min_wait_s; its class = its priority value)
    while its queue uses less than its nominal quota of some resource and more of none (under its guarantee);
    its queue is then admitted in strict order (StrictFIFO) for the cycle: no job behind it in the queue's order
    (same or lower priority, later order time) is admitted before it.

Only the queue's oldest pending job is looked at (a lazy heap of submit times, O(log n) per change). The class
median is over the admission waits of that priority's last `WINDOW` admissions (a job requeued after a
preemption is left out of both the record and the rule: its wait since submission includes its run). With the
queue blocked behind it, its own jobs that end free its quota and nothing else of the queue takes it, so the job
is admitted once its queue's running jobs have given back what it asks (at most their limits), plus the time to
reclaim lent quota (the reclaim guarantee: protection window + checkpoint grace): its wait is bounded by
threshold + that drain. Pure: `now` is handed in; ties broken by job id.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping

WINDOW = 200  # admissions per class the median is taken over (the duration predictor's window, predict.py)


class StarvationWatch:
    """Per class, the recent admission waits; per queue, its pending jobs by submit time."""

    __slots__ = ("_median", "_oldest", "_requeued", "_waits", "starving")

    def __init__(self) -> None:
        self._waits: dict[int, deque[float]] = {}  # priority -> last WINDOW admission waits
        self._median: dict[int, float] = {}  # priority -> median of _waits, until the next record
        self._oldest: dict[str, list[tuple[float, str]]] = {}  # queue -> heap of (submitted_at, job id)
        self._requeued: set[str] = set()  # pending again after a preemption: not judged, not recorded
        self.starving: dict[str, str] = {}  # queue -> its starved job, as of the last `judge`

    def copy(self) -> StarvationWatch:
        other = StarvationWatch()
        other._waits = {p: deque(w, maxlen=WINDOW) for p, w in self._waits.items()}
        other._median = dict(self._median)
        other._oldest = {q: list(h) for q, h in self._oldest.items()}
        other._requeued = set(self._requeued)
        other.starving = dict(self.starving)
        return other

    def pending(self, queue: str, job_id: str, submitted_at: float, *, requeued: bool) -> None:
        if requeued:
            self._requeued.add(job_id)
            return
        self._requeued.discard(job_id)
        heapq.heappush(self._oldest.setdefault(queue, []), (submitted_at, job_id))

    def admitted(self, job_id: str, priority: int, wait_s: float) -> None:
        if job_id in self._requeued:
            self._requeued.discard(job_id)
            return
        waits = self._waits.get(priority)
        if waits is None:
            waits = self._waits[priority] = deque(maxlen=WINDOW)
        waits.append(max(0.0, wait_s))
        self._median.pop(priority, None)

    def median(self, priority: int) -> float:
        """Median admission wait of the class's last WINDOW admissions (0 with none yet)."""
        m = self._median.get(priority)
        if m is None:
            ordered = sorted(self._waits.get(priority, ()))
            n = len(ordered)
            m = 0.0 if not n else (ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2)
            self._median[priority] = m
        return m

    def threshold(self, priority: int, factor: float, floor_s: float) -> float:
        return max(factor * self.median(priority), floor_s)

    def judge(self, now: float, factor: float | None, floor_s: float,
              pending: Callable[[str], tuple[int, float] | None],
              under_guarantee: Callable[[str], bool]) -> tuple[dict[str, str], set[str]]:
        """The queues whose oldest pending job has starved (queue -> job), and the queues whose state changed
        since the last call. `pending(job_id)`: (priority, submitted_at) of a job still pending and admissible,
        else None (popped from the heap, lazily)."""
        found: dict[str, str] = {}
        if factor is not None:
            for q in sorted(self._oldest):
                heap = self._oldest[q]
                while heap:
                    submitted, job_id = heap[0]
                    info = None if job_id in self._requeued else pending(job_id)
                    if info is None or info[1] != submitted:
                        heapq.heappop(heap)
                        continue
                    break
                if not heap:
                    del self._oldest[q]
                    continue
                submitted, job_id = heap[0]
                info = pending(job_id)
                assert info is not None
                if now - submitted >= self.threshold(info[0], factor, floor_s) and under_guarantee(q):
                    found[q] = job_id
        changed = {q for q in set(found) | set(self.starving) if found.get(q) != self.starving.get(q)}
        self.starving = found
        return found, changed


def under_guarantee(used: Mapping[str, int], nominal: Mapping[str, int]) -> bool:
    """A queue uses less than its nominal quota of some resource and more of none."""
    below = False
    for r, n in nominal.items():
        u = used.get(r, 0)
        if u > n:
            return False
        below = below or u < n
    return below
