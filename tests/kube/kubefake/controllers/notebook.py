"""Kubeflow's notebook controller (kubeflow.org/v1 Notebook), reduced to what gpuq observes: the notebook's pod.

The real controller runs a Notebook as a StatefulSet of one replica (`<notebook>`, pods `<notebook>-0`) and a Service;
the fake makes the pod itself (no StatefulSet object), as that StatefulSet would: `<notebook>-0`, from
`spec.template.spec`, labelled `statefulset` and `notebook-name` with the Notebook's own labels copied, and the
Notebook's annotations copied but those whose key contains `notebook` or `kubectl` (what the real controller does).
The annotation `kubeflow-resource-stopped` scales it to 0: the pod is deleted. A pod that ended is made again (a
StatefulSet keeps its replica). Status: readyReplicas, and containerState and the Running/Ready conditions from the
pod. Not emulated: the StatefulSet and Service objects, the culler, Istio, PodDefaults, rolling updates of a running
pod when the template changes (gpuq changes it only while the Notebook is stopped)."""

from __future__ import annotations

from ..resources import NOTEBOOKS, PODS
from ..store import Obj
from .common import WorkloadController, create_from_template, delete_pods, is_active, is_ready, owned, write_status

STOPPED = "kubeflow-resource-stopped"


class NotebookController(WorkloadController):
    resource = NOTEBOOKS

    def sync(self, nb: Obj) -> None:
        meta = nb["metadata"]
        pods = [p for p in owned(self.store, PODS, nb) if not p["metadata"].get("deletionTimestamp")]
        if STOPPED in (meta.get("annotations") or {}):
            delete_pods(self.store, pods)
            pods = []
        else:
            for pod in pods:
                if not is_active(pod):  # the StatefulSet replaces a pod that ended
                    delete_pods(self.store, [pod])
            pods = [p for p in pods if is_active(p)]
            if not pods:
                name = meta["name"]
                annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                               if "notebook" not in k and "kubectl" not in k}
                pods = [create_from_template(
                    self.store, PODS, nb, {"spec": (nb["spec"].get("template") or {}).get("spec") or {}},
                    name=f"{name}-0", labels={**(meta.get("labels") or {}), "statefulset": name,
                                               "notebook-name": name},
                    annotations=annotations)]
        ready = sum(1 for p in pods if is_ready(p))
        now = self.store.clock.stamp()

        def status(s: Obj) -> None:
            s["readyReplicas"] = ready
            state = ((pods[0]["status"].get("containerStatuses") or [{}])[0].get("state") if pods else None) or {}
            s["containerState"] = state
            if ready and not any(c.get("type") == "Ready" for c in s.get("conditions") or []):
                s.setdefault("conditions", []).append({"type": "Ready", "status": "True", "lastProbeTime": now})
            if not ready:
                s["conditions"] = [c for c in s.get("conditions") or [] if c.get("type") != "Ready"]

        write_status(self.store, NOTEBOOKS, nb, status)
