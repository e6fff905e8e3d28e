"""Kubeflow `kubeflow.org/v1` PyTorchJob: one pod set per replica type (Master, Worker), suspended through
`runPolicy.suspend`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from services.core.kube.workload import (
    Conclusion,
    Finish,
    Obj,
    PodSetTemplate,
    WorkloadKind,
    condition_reason,
    conditions,
    register,
    true_condition,
)

ORDER = {"master": 0, "worker": 1}


class PyTorchJob(WorkloadKind):
    """Also the Kubeflow kinds of the same shape (TFJob, MPIJob v2beta1): replica specs under `replicas_key`,
    `runPolicy.suspend`, the kubeflow common JobConditions (Succeeded, Failed, Suspended)."""

    api_version, kind, plural = "kubeflow.org/v1", "PyTorchJob", "pytorchjobs"
    replicas_key: ClassVar[str] = "pytorchReplicaSpecs"
    order: ClassVar[Mapping[str, int]] = ORDER  # replica type (lower case) -> rank; unknown types after, by name

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        replicas = (obj.get("spec") or {}).get(self.replicas_key) or {}
        sets = [PodSetTemplate(rtype.lower(), max(1, int(r.get("replicas", 1))), dict(r.get("template") or {}))
                for rtype, r in replicas.items()]
        sets = [self._elastic(obj, p) for p in sets]
        return sorted(sets, key=lambda p: (self.order.get(p.name, len(self.order)), p.name))

    def _elastic(self, obj: Obj, ps: PodSetTemplate) -> PodSetTemplate:
        """A PyTorchJob's `elasticPolicy` (minReplicas..maxReplicas) makes its Worker pod set elastic: at most
        maxReplicas (else its replicas), at least minReplicas (else 1)."""
        policy = (obj.get("spec") or {}).get("elasticPolicy")
        if self.kind != "PyTorchJob" or not policy or ps.name != "worker":
            return ps
        most = max(1, int(policy.get("maxReplicas", ps.count)))
        return replace(ps, count=most, min_count=min(most, max(1, int(policy.get("minReplicas", 1)))))

    def replicas_patch(self, obj: Obj, counts: Mapping[str, int]) -> dict[str, Any]:
        replicas = (obj.get("spec") or {}).get(self.replicas_key) or {}
        return {"spec": {self.replicas_key: {rtype: {"replicas": counts[rtype.lower()]} for rtype in sorted(replicas)
                                             if rtype.lower() in counts}}}

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        for rtype, r in (spec.get(self.replicas_key) or {}).items():
            if rtype.lower() in templates:
                r["template"] = templates[rtype.lower()]

    def suspended(self, obj: Obj) -> bool:
        return bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"spec": {"runPolicy": {"suspend": suspend}}}

    def finished(self, obj: Obj) -> Finish | None:
        if (c := true_condition(obj, "Succeeded")) is not None:
            return Finish(True, c.get("reason") or "Succeeded", c.get("message") or "")
        if (c := true_condition(obj, "Failed")) is not None:
            return Finish(False, c.get("reason") or "Failed", c.get("message") or "")
        return None

    def stopped(self, obj: Obj) -> bool:
        """Suspended, and the training operator has deleted its pods (condition Suspended)."""
        return self.suspended(obj) and true_condition(obj, "Suspended") is not None

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """Condition Failed, last (kubectl's STATE column reads the last condition), Running set False and the
        completion time, as the training operator writes a failed job (which it then only cleans up)."""
        kept = []
        for c in conditions(obj):
            if c.get("type") == "Failed":
                continue
            c = dict(c)
            if c.get("type") == "Running" and c.get("status") != "False":
                c.update(status="False", lastUpdateTime=now, lastTransitionTime=now)
            kept.append(c)
        kept.append({"type": "Failed", "status": "True", "reason": condition_reason(reason), "message": message,
                     "lastUpdateTime": now, "lastTransitionTime": now})
        status: dict[str, Any] = {"conditions": kept}
        if not (obj.get("status") or {}).get("completionTime"):
            status["completionTime"] = now
        return Conclusion({"status": status}, status=True)

    def active_deadline_s(self, obj: Obj) -> int | None:
        value = ((obj.get("spec") or {}).get("runPolicy") or {}).get("activeDeadlineSeconds")
        return int(value) if value is not None else None


PYTORCHJOB = register(PyTorchJob())
