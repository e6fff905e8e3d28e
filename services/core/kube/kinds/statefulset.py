"""`apps/v1` StatefulSet: one pod set `main` of `replicas` pods from `spec.template`, for GPU StatefulSets a user
creates in a namespace gpuq manages (inference servers, interactive work).

A StatefulSet has no suspend field. gpuq holds one at `replicas: 0` with the pods to run in the annotation
`gpuq.io/replicas` (the webhook writes it from `replicas` when it holds a GPU StatefulSet created running; an author
creating it held writes both), starts it with them back, and stops it at 0. It never finishes by itself; gpuq ends
one by leaving it at 0. A StatefulSet another supported workload controls (a Kubeflow Notebook's) is that workload's:
the webhook leaves it alone and the intake sees no queue label on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube import names as n
from services.core.kube.workload import Conclusion, Finish, Obj, PodSetTemplate, WorkloadKind, register

POD_SET = "main"


def replicas(obj: Obj) -> int:
    """The pods to run: the annotation while held, else `replicas` (default 1)."""
    annotations = ((obj.get("metadata") or {}).get("annotations")) or {}
    if n.REPLICAS_ANNOTATION in annotations:
        return int(annotations[n.REPLICAS_ANNOTATION])
    return int((obj.get("spec") or {}).get("replicas", 1))


class StatefulSet(WorkloadKind):
    api_version, kind, plural = "apps/v1", "StatefulSet", "statefulsets"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        return [PodSetTemplate(POD_SET, max(1, replicas(obj)), dict((obj.get("spec") or {}).get("template") or {}))]

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        if POD_SET in templates:
            spec["template"] = templates[POD_SET]

    def run_patch(self, obj: Obj, templates: Mapping[str, dict[str, Any]], *, suspend: bool = False
                  ) -> dict[str, Any]:
        patch = super().run_patch(obj, templates, suspend=suspend)
        if not suspend:
            patch["spec"]["replicas"] = replicas(obj)
        return patch

    def hold_annotations(self, obj: Obj) -> dict[str, str]:
        return {n.REPLICAS_ANNOTATION: str(replicas(obj))}

    def suspended(self, obj: Obj) -> bool:
        return int((obj.get("spec") or {}).get("replicas", 1)) == 0

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """Held: no pods. (Started by `run_patch`, which gives the replicas back.)"""
        return {"spec": {"replicas": 0}} if suspend else {}

    def stopped(self, obj: Obj) -> bool:
        """Held, and the StatefulSet controller has deleted its pods (status.replicas 0)."""
        return self.suspended(obj) and not int((obj.get("status") or {}).get("replicas") or 0)

    def finished(self, obj: Obj) -> Finish | None:
        return None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Left at 0 replicas (the StatefulSet controller owns its status); gpuq's reason is on its Event and
        `gpuq.io/status`."""
        return Conclusion(self.suspend_patch(True), status=False)

    def active_deadline_s(self, obj: Obj) -> int | None:
        return None


STATEFULSET = register(StatefulSet())
