"""`ClusterState`: the cluster index (index.py) plus the placement queries every caller asks of it.

The layering is one-way: index (data) <- staging/diagnose/placer (decisions over the index's public API) <-
this module (the convenience methods). Nothing below imports anything above it, so there is no cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.domain import JobSpec

from .index import STRATEGIES, CallableInt, ClusterIndex, natural_key
from .placer import place_job
from .types import Placement, Unplaceable


class ClusterState(ClusterIndex):
    """A mutable snapshot of the cluster's nodes and the placements committed on them, with placement queries."""

    def place(self, job: JobSpec, allowed_models: Sequence[str] | None = None) -> Placement | Unplaceable:
        """Where the whole gang would go now, or why it cannot. A pure query: the state is not changed."""
        return place_job(self, job, tuple(allowed_models or ()))

    def fits_if_released(self, job: JobSpec, victims: Sequence[str],
                         allowed_models: Sequence[str] | None = None) -> Placement | Unplaceable:
        """Would `job` fit if the running jobs `victims` were released? Decided on a copy: `self` is untouched."""
        what_if = self.copy()
        for job_id in sorted(set(victims)):
            what_if.release(job_id)
        return what_if.place(job, allowed_models)


__all__ = ["STRATEGIES", "CallableInt", "ClusterState", "natural_key"]
