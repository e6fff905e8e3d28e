"""`jobset.x-k8s.io/v1alpha2` JobSet: one pod set per replicated job (replicas × parallelism pods)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.core.kube.workload import (
    Conclusion,
    Finish,
    Obj,
    PodSetTemplate,
    WorkloadKind,
    condition_reason,
    register,
    true_condition,
    with_condition,
)


class JobSet(WorkloadKind):
    api_version, kind, plural = "jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        out = []
        for rj in (obj.get("spec") or {}).get("replicatedJobs") or []:
            job_spec = (rj.get("template") or {}).get("spec") or {}
            per_job = int(job_spec.get("parallelism", 1))
            out.append(PodSetTemplate(rj["name"], max(1, int(rj.get("replicas", 1)) * per_job),
                                      dict(job_spec.get("template") or {})))
        return out

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        for rj in spec.get("replicatedJobs") or []:
            if rj["name"] in templates:
                rj.setdefault("template", {}).setdefault("spec", {})["template"] = templates[rj["name"]]

    def suspended(self, obj: Obj) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"spec": {"suspend": suspend}}

    def finished(self, obj: Obj) -> Finish | None:
        if (c := true_condition(obj, "Completed")) is not None:
            return Finish(True, c.get("reason") or "Completed", c.get("message") or "")
        if (c := true_condition(obj, "Failed")) is not None:
            return Finish(False, c.get("reason") or "Failed", c.get("message") or "")
        return None

    def stopped(self, obj: Obj) -> bool:
        """Suspended, and the JobSet controller has suspended its child Jobs (condition Suspended)."""
        return self.suspended(obj) and true_condition(obj, "Suspended") is not None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Condition Failed and terminalState Failed, as the JobSet controller writes a failed JobSet (which it
        then only cleans up)."""
        return Conclusion({"status": {
            "conditions": with_condition(obj, "Failed", "True", condition_reason(reason), message, now),
            "terminalState": "Failed"}}, status=True)

    def build(self, name: str, namespace: str, pod_sets: list[PodSetTemplate], labels: Mapping[str, str],
              annotations: Mapping[str, str]) -> dict[str, Any]:
        replicated = [{"name": ps.name, "replicas": 1,
                       "template": {"spec": {"completionMode": "Indexed", "completions": ps.count,
                                             "parallelism": ps.count, "backoffLimit": 0, "template": ps.template}}}
                      for ps in pod_sets]
        return {"apiVersion": self.api_version, "kind": self.kind,
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                             "annotations": dict(annotations)},
                "spec": {"suspend": True, "replicatedJobs": replicated,
                         "failurePolicy": {"maxRestarts": 0}}}


JOBSET = register(JobSet())
