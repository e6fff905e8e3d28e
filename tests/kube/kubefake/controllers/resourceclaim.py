"""kube-controller-manager's resourceclaim controller, the part gpuq relies on: a pod naming a ResourceClaimTemplate
(spec.resourceClaims[].resourceClaimTemplateName) gets a ResourceClaim of its own made from it, owned by the pod
(gone with it), annotated `resource.kubernetes.io/pod-claim-name`, and recorded in the pod's
status.resourceClaimStatuses. It allocates nothing: that is kube-scheduler's DRA plugin, or whoever writes
status.allocation first (gpuq does, for the devices it chose)."""

from __future__ import annotations

from ..errors import KubernetesError
from ..resources import PODS, RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS
from ..store import TERMINAL_POD_PHASES, Obj, Store

POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


class ResourceClaimController:
    def __init__(self, store: Store) -> None:
        self.store = store

    def reconcile(self) -> bool:
        before = self.store.resource_version
        for pod in self.store.list(PODS):
            if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") in TERMINAL_POD_PHASES:
                continue
            made = {s.get("name") for s in pod["status"].get("resourceClaimStatuses") or []}
            for claim in pod["spec"].get("resourceClaims") or []:
                if claim.get("resourceClaimTemplateName") and claim.get("name") not in made:
                    self._make(pod, claim)
        return self.store.resource_version != before

    def _make(self, pod: Obj, claim: Obj) -> None:
        meta = pod["metadata"]
        namespace = meta["namespace"]
        template = self.store.find(RESOURCE_CLAIM_TEMPLATES, namespace, claim["resourceClaimTemplateName"])
        if template is None:
            return  # the real controller retries until the template exists
        owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "controller": True,
                 "blockOwnerDeletion": True}
        tmeta = (template.get("spec") or {}).get("metadata") or {}
        body: Obj = {"metadata": {
            "generateName": f"{meta['name']}-{claim['name']}-"[:58],
            "labels": dict(tmeta.get("labels") or {}),
            "annotations": {**(tmeta.get("annotations") or {}), POD_CLAIM_NAME_ANNOTATION: claim["name"]},
            "ownerReferences": [owner]}, "spec": (template.get("spec") or {}).get("spec") or {}}
        try:
            made = self.store.create(RESOURCE_CLAIMS, namespace, body)
        except KubernetesError:
            return

        def record(p: Obj) -> None:
            statuses = p["status"].setdefault("resourceClaimStatuses", [])
            statuses.append({"name": claim["name"], "resourceClaimName": made["metadata"]["name"]})

        self.store.mutate(PODS, namespace, meta["name"], record)
