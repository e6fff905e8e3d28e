"""The StatefulSet controller (apps/v1), reduced to what gpuq observes: pods `<sts>-<ordinal>` for each ordinal below
`spec.replicas`, from `spec.template`, labelled `statefulset.kubernetes.io/pod-name` and `apps.kubernetes.io/
pod-index`; ordinals at or above `replicas` are deleted; a pod that ended is made again. Status: replicas (pods),
readyReplicas, currentReplicas. Not emulated: ordered (OrderedReady) creation and deletion, rolling updates and
controller revisions, volumeClaimTemplates and PVCs, minReadySeconds, the headless Service."""

from __future__ import annotations

from ..resources import PODS, STATEFULSETS
from ..store import Obj
from .common import WorkloadController, create_from_template, delete_pods, is_active, is_ready, owned, write_status


class StatefulSetController(WorkloadController):
    resource = STATEFULSETS

    def sync(self, sts: Obj) -> None:
        name = sts["metadata"]["name"]
        replicas = int(sts["spec"].get("replicas", 1))
        wanted = {f"{name}-{i}": i for i in range(replicas)}
        pods = [p for p in owned(self.store, PODS, sts) if not p["metadata"].get("deletionTimestamp")]
        delete_pods(self.store, [p for p in pods if p["metadata"]["name"] not in wanted or not is_active(p)])
        live = {p["metadata"]["name"]: p for p in pods if p["metadata"]["name"] in wanted and is_active(p)}
        for pod_name, ordinal in sorted(wanted.items()):
            if pod_name not in live:
                live[pod_name] = create_from_template(
                    self.store, PODS, sts, sts["spec"].get("template") or {}, name=pod_name,
                    labels={"statefulset.kubernetes.io/pod-name": pod_name,
                            "apps.kubernetes.io/pod-index": str(ordinal)})
        ready = sum(1 for p in live.values() if is_ready(p))

        def status(s: Obj) -> None:
            s["replicas"] = s["currentReplicas"] = len(live)
            s["readyReplicas"] = ready

        write_status(self.store, STATEFULSETS, sts, status)
