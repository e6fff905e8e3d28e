"""Kubeflow `kubeflow.org/v1` Notebook: one pod (the notebook controller's StatefulSet of one replica), in job class
`notebook` unless annotated otherwise (`gpuq.io/kind`).

A Notebook is stopped as Kubeflow stops one (the dashboard's Stop): the annotation `kubeflow-resource-stopped`, which
makes the notebook controller scale its StatefulSet to 0; removing it starts the notebook again. Its pod template
(`spec.template`) has a spec only: the notebook controller gives the pod the Notebook's own labels and annotations, so
gpuq's pod-template keys (job and pod-set labels, job id and resume point) are written on the Notebook itself. A
Notebook never finishes by itself; gpuq ends one (TTL, idle reclaim with action `end`, cancellation) by leaving it
stopped, its reason on its Event and `gpuq.io/status`."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from services.core.kube import names as n
from services.core.kube.workload import Conclusion, Finish, Obj, PodSetTemplate, WorkloadKind, register

STOPPED_ANNOTATION = "kubeflow-resource-stopped"
POD_SET = "notebook"
# gpuq's keys in a pod template's metadata, which a Notebook carries on its own metadata (placement.placed_template)
TEMPLATE_LABELS = (n.JOB_LABEL, n.POD_SET_LABEL)
TEMPLATE_ANNOTATIONS = (n.JOB_ID_ANNOTATION, n.RESUME_FROM_ANNOTATION)
STOPPED_BY_GPUQ = "gpuq"  # the annotation's value when gpuq stopped it (Kubeflow writes a time; only presence counts)


class Notebook(WorkloadKind):
    api_version, kind, plural = "kubeflow.org/v1", "Notebook", "notebooks"
    job_kind = "notebook"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        meta = obj.get("metadata") or {}
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        template: dict[str, Any] = {"spec": copy.deepcopy(((obj.get("spec") or {}).get("template") or {})
                                                           .get("spec") or {})}
        ours = {"labels": {k: labels[k] for k in TEMPLATE_LABELS if k in labels},
                "annotations": {k: annotations[k] for k in TEMPLATE_ANNOTATIONS if k in annotations}}
        if ours["labels"] or ours["annotations"]:
            template["metadata"] = {k: v for k, v in ours.items() if v}
        return [PodSetTemplate(POD_SET, 1, template)]

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        if POD_SET in templates:
            spec.setdefault("template", {})["spec"] = copy.deepcopy(templates[POD_SET].get("spec") or {})

    def run_patch(self, obj: Obj, templates: Mapping[str, dict[str, Any]], *, suspend: bool = False
                  ) -> dict[str, Any]:
        """The template's spec into `spec.template.spec`, its gpuq keys (null: removed) onto the Notebook's metadata,
        where the notebook controller copies them to the pod; and started (or, with `suspend`, left stopped)."""
        patch = super().run_patch(obj, templates, suspend=suspend)
        meta = (templates.get(POD_SET) or {}).get("metadata") or {}
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        out = patch.setdefault("metadata", {})
        out.setdefault("labels", {}).update({k: labels.get(k) for k in TEMPLATE_LABELS})
        out.setdefault("annotations", {}).update({k: annotations.get(k) for k in TEMPLATE_ANNOTATIONS})
        return patch

    def suspended(self, obj: Obj) -> bool:
        return STOPPED_ANNOTATION in (((obj.get("metadata") or {}).get("annotations")) or {})

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"metadata": {"annotations": {STOPPED_ANNOTATION: STOPPED_BY_GPUQ if suspend else None}}}

    def stopped(self, obj: Obj) -> bool:
        """Stopped, and the notebook controller has scaled its StatefulSet to 0 (status.readyReplicas 0)."""
        return self.suspended(obj) and not int((obj.get("status") or {}).get("readyReplicas") or 0)

    def finished(self, obj: Obj) -> Finish | None:
        return None  # a notebook runs until it is stopped

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Left stopped (the annotation again, which changes nothing): the notebook controller owns its status, and a
        stopped Notebook is what Kubeflow shows as ended; gpuq's reason is on its Event and `gpuq.io/status`."""
        return Conclusion(self.suspend_patch(True), status=False)

    def active_deadline_s(self, obj: Obj) -> int | None:
        return None


NOTEBOOK = register(Notebook())
