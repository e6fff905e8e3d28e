"""`batch/v1` Job, Indexed or not: one pod set of `parallelism` pods."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube.workload import (
    Conclusion,
    Finish,
    Obj,
    PodSetTemplate,
    WorkloadKind,
    register,
    true_condition,
)


class Job(WorkloadKind):
    api_version, kind, plural = "batch/v1", "Job", "jobs"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        spec = obj.get("spec") or {}
        parallelism = int(spec.get("parallelism", 1))
        completions = spec.get("completions")
        count = min(parallelism, int(completions)) if completions is not None else parallelism
        return [PodSetTemplate("main", max(1, count), dict(spec.get("template") or {}))]

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        # One pod set: "main" when taken in from the cluster, the submitter's name when created from an event.
        (only,) = templates.values()
        spec["template"] = only

    def suspended(self, obj: Obj) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"spec": {"suspend": suspend}}

    def finished(self, obj: Obj) -> Finish | None:
        if (c := true_condition(obj, "Complete", "SuccessCriteriaMet")) is not None:
            return Finish(True, c.get("reason") or "Completed", c.get("message") or "")
        if (c := true_condition(obj, "Failed", "FailureTarget")) is not None:
            return Finish(False, c.get("reason") or "Failed", c.get("message") or "")
        return None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """A Job's status belongs to the Job controller (the API server validates what others write there), so
        gpuq has that controller fail it: resumed with no pod to run (parallelism 0) and one second left
        (activeDeadlineSeconds 1), the Job is marked Failed with reason DeadlineExceeded a second later, as any
        Job past its deadline, and never runs a pod again. gpuq's own reason is on its Event and annotation."""
        return Conclusion({"spec": {"suspend": False, "parallelism": 0, "activeDeadlineSeconds": 1}}, status=False)

    def build(self, name: str, namespace: str, pod_sets: list[PodSetTemplate], labels: Mapping[str, str],
              annotations: Mapping[str, str]) -> dict[str, Any]:
        (only,) = pod_sets
        return {"apiVersion": self.api_version, "kind": self.kind,
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                             "annotations": dict(annotations)},
                "spec": {"completionMode": "Indexed", "completions": only.count, "parallelism": only.count,
                         "backoffLimit": 0, "suspend": True, "template": only.template}}


JOB = register(Job())
