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
from services.core.kube.kinds.scaled import HeldAtZeroReplicas, held_count
from services.core.kube.workload import Obj, PodSetTemplate, register

POD_SET = "main"


def replicas(obj: Obj) -> int:
    """The pods to run: the annotation while held, else `replicas` (default 1)."""
    return held_count(obj, n.REPLICAS_ANNOTATION)


class StatefulSet(HeldAtZeroReplicas):
    api_version, kind, plural = "apps/v1", "StatefulSet", "statefulsets"
    held_annotation = n.REPLICAS_ANNOTATION

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        return [PodSetTemplate(POD_SET, max(1, replicas(obj)), dict((obj.get("spec") or {}).get("template") or {}))]

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        if POD_SET in templates:
            spec["template"] = templates[POD_SET]


STATEFULSET = register(StatefulSet())
