"""Workloads with no suspend field, held at `spec.replicas: 0` (a StatefulSet, a LeaderWorkerSet).

gpuq holds one at zero with the count to run in an annotation of its own (`held_annotation`: the webhook writes it
from `replicas` when it holds one created running; an author creating it held writes both), starts it with that
count back, and stops it at zero (its controller then deletes the pods). It never finishes by itself (a serving
workload); gpuq ends one by leaving it at zero, its controller owning its status."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube.workload import Conclusion, Finish, Obj, WorkloadKind


def held_count(obj: Obj, annotation: str) -> int:
    """The count to run: the annotation while held, else `replicas` (default 1)."""
    annotations = ((obj.get("metadata") or {}).get("annotations")) or {}
    if annotation in annotations:
        return int(annotations[annotation])
    return int((obj.get("spec") or {}).get("replicas", 1))


class HeldAtZeroReplicas(WorkloadKind):
    """The hold, start, stop and end of a workload scaled through `spec.replicas`."""

    held_annotation: str  # where the count to run is kept while held

    def run_patch(self, obj: Obj, templates: Mapping[str, dict[str, Any]], *, suspend: bool = False
                  ) -> dict[str, Any]:
        patch = super().run_patch(obj, templates, suspend=suspend)
        if not suspend:
            patch["spec"]["replicas"] = held_count(obj, self.held_annotation)
        return patch

    def hold_annotations(self, obj: Obj) -> dict[str, str]:
        return {self.held_annotation: str(held_count(obj, self.held_annotation))}

    def suspended(self, obj: Obj) -> bool:
        return int((obj.get("spec") or {}).get("replicas", 1)) == 0

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """Held: zero replicas. (Started by `run_patch`, which gives the count back.)"""
        return {"spec": {"replicas": 0}} if suspend else {}

    def stopped(self, obj: Obj) -> bool:
        """Held, and its controller has deleted what ran (status.replicas 0)."""
        return self.suspended(obj) and not int((obj.get("status") or {}).get("replicas") or 0)

    def finished(self, obj: Obj) -> Finish | None:
        return None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Left at zero replicas; gpuq's reason is on its Event and `gpuq.io/status`."""
        return Conclusion(self.suspend_patch(True), status=False)

    def active_deadline_s(self, obj: Obj) -> int | None:
        return None
