"""KubeRay `ray.io/v1` RayJob: the head (one pod) and one pod set per worker group. The submitter pod is not
gpuq's (it asks for no GPU and runs outside the gang)."""

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
)

HEAD = "head"


class RayJob(WorkloadKind):
    api_version, kind, plural = "ray.io/v1", "RayJob", "rayjobs"

    def pod_sets(self, obj: Obj) -> list[PodSetTemplate]:
        cluster = (obj.get("spec") or {}).get("rayClusterSpec") or {}
        head = (cluster.get("headGroupSpec") or {}).get("template") or {}
        out = [PodSetTemplate(HEAD, 1, dict(head))]
        autoscaled = bool(cluster.get("enableInTreeAutoscaling"))
        for g in cluster.get("workerGroupSpecs") or []:
            replicas = int(g.get("replicas", g.get("minReplicas", 1)))
            most = int(g.get("maxReplicas", replicas))
            if autoscaled and most > max(1, int(g.get("minReplicas", 0))):
                # the Ray autoscaler's range, as an elastic pod set: at least minReplicas (and 1), at most max
                out.append(PodSetTemplate(g["groupName"], most, dict(g.get("template") or {}),
                                          max(1, int(g.get("minReplicas", 0)))))
            elif replicas > 0:
                out.append(PodSetTemplate(g["groupName"], replicas, dict(g.get("template") or {})))
        return out

    def replicas_patch(self, obj: Obj, counts: Mapping[str, int]) -> dict[str, Any]:
        """The worker groups' replicas (the list is replaced whole: a merge patch cannot address one item)."""
        cluster = (obj.get("spec") or {}).get("rayClusterSpec") or {}
        groups = [dict(g, replicas=counts[g["groupName"]]) if g.get("groupName") in counts else dict(g)
                  for g in cluster.get("workerGroupSpecs") or []]
        return {"spec": {"rayClusterSpec": {"workerGroupSpecs": groups}}} if groups else {}

    def all_templates(self, obj: Obj) -> list[PodSetTemplate]:
        """The head, every worker group (those scaled to zero too: the autoscaler may start them) and the
        submitter pod KubeRay runs `ray job submit` in."""
        spec = obj.get("spec") or {}
        cluster = spec.get("rayClusterSpec") or {}
        out = [PodSetTemplate(HEAD, 1, dict((cluster.get("headGroupSpec") or {}).get("template") or {}))]
        out += [PodSetTemplate(str(g.get("groupName", "")), max(1, int(g.get("replicas", g.get("minReplicas", 1)))),
                               dict(g.get("template") or {})) for g in cluster.get("workerGroupSpecs") or []]
        if spec.get("submitterPodTemplate"):
            out.append(PodSetTemplate("submitter", 1, dict(spec["submitterPodTemplate"])))
        return out

    def with_templates(self, spec: dict[str, Any], templates: Mapping[str, dict[str, Any]]) -> None:
        cluster = spec.setdefault("rayClusterSpec", {})
        if HEAD in templates:
            cluster.setdefault("headGroupSpec", {})["template"] = templates[HEAD]
        for g in cluster.get("workerGroupSpecs") or []:
            if g["groupName"] in templates:
                g["template"] = templates[g["groupName"]]

    def suspended(self, obj: Obj) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"spec": {"suspend": suspend}}

    def stopped(self, obj: Obj) -> bool:
        """Suspended, and KubeRay has deleted its RayCluster (jobDeploymentStatus Suspended)."""
        return self.suspended(obj) and (obj.get("status") or {}).get("jobDeploymentStatus") == "Suspended"

    def conclusion(self, obj: Obj, reason: str, message: str, now: str) -> Conclusion:
        """jobDeploymentStatus Failed with a reason, a message and the end time, as KubeRay writes a RayJob that
        failed (which it then only cleans up)."""
        return Conclusion({"status": {"jobDeploymentStatus": "Failed", "reason": condition_reason(reason),
                                      "message": message, "endTime": now}}, status=True)

    def finished(self, obj: Obj) -> Finish | None:
        status = obj.get("status") or {}
        job_status = status.get("jobStatus")
        deployment = status.get("jobDeploymentStatus")
        if job_status == "SUCCEEDED":
            return Finish(True, "Succeeded", status.get("message") or "")
        if job_status in ("FAILED", "STOPPED") or deployment == "Failed":
            return Finish(False, status.get("reason") or job_status or "Failed", status.get("message") or "")
        return None


RAYJOB = register(RayJob())
