"""The workloads waiting for admission, counted per team: the per-team cap (limits.py) reads a team's count on
every submission, so it is kept incrementally instead of counted. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from services.core.admission.model import Workload


class PendingWorkloads:
    """job_id -> Workload of every job waiting for admission (inadmissible ones included), with each team's count."""

    __slots__ = ("_per_team", "_workloads")

    def __init__(self) -> None:
        self._workloads: dict[str, Workload] = {}
        self._per_team: dict[str, int] = {}  # team -> its jobs in _workloads

    def view(self) -> Mapping[str, Workload]:
        """A read-only view (it follows later changes)."""
        return MappingProxyType(self._workloads)

    def of_team(self, team: str) -> int:
        return self._per_team.get(team, 0)

    def put(self, w: Workload) -> None:
        """Add `w`, or replace the workload waiting under its job id (counted once)."""
        previous = self._workloads.get(w.spec.job_id)
        if previous is not None:
            self._count(previous.spec.team, -1)
        self._workloads[w.spec.job_id] = w
        self._count(w.spec.team, 1)

    def pop(self, job_id: str) -> None:
        """Forget the job (admitted, finished or replaced); nothing if it does not wait."""
        w = self._workloads.pop(job_id, None)
        if w is not None:
            self._count(w.spec.team, -1)

    def copy(self) -> PendingWorkloads:
        other = PendingWorkloads()
        other._workloads = dict(self._workloads)
        other._per_team = dict(self._per_team)
        return other

    def _count(self, team: str, delta: int) -> None:
        count = self._per_team.get(team, 0) + delta
        if count > 0:
            self._per_team[team] = count
        else:
            self._per_team.pop(team, None)
