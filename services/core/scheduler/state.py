"""`ClusterState`: the cluster index (index.py) plus the placement queries every caller asks of it.

The layering is one-way: index (data) <- staging/diagnose/placer (decisions over the index's public API) <-
this module (the convenience methods). Nothing below imports anything above it, so there is no cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.domain import JobSpec

from .index import STRATEGIES, CallableInt, ClusterIndex, natural_key
from .placer import place_job, resolve, try_place
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
        what_if.release_many(sorted(set(victims)))
        return what_if.place(job, allowed_models)

    def try_place(self, job: JobSpec, allowed_models: Sequence[str] | None = None) -> Placement | None:
        """`place` without the diagnosis: the same placement, or None where `place` would explain why not (for
        callers that only ask whether the gang fits, e.g. victim selection's what-if placements)."""
        reqs = resolve(job, tuple(allowed_models or ()))
        if isinstance(reqs, Unplaceable):
            return None
        return try_place(self, job, reqs)

    def try_place_if_released(self, job: JobSpec, victims: Iterable[str],
                              allowed_models: Sequence[str] | None = None) -> Placement | None:
        """`fits_if_released` without the diagnosis: the placement it finds, or None where it explains why not."""
        what_if = self.copy()
        what_if.release_many(sorted(set(victims)))
        return what_if.try_place(job, allowed_models)


__all__ = ["STRATEGIES", "CallableInt", "ClusterState", "natural_key"]
