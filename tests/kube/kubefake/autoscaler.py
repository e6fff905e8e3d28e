"""A fake cluster-autoscaler for ProvisioningRequests (autoscaling.x-k8s.io/v1), which a test plays: each
`reconcile()` answers the requests not answered yet, as the real one's provisioning classes do
(cluster-autoscaler/provisioningrequest): `check-capacity.autoscaling.x-k8s.io` sets Provisioned=True
(CapacityIsFound) when the nodes there now hold every pod of the request, else Provisioned=False (CapacityIsNotFound,
"CA will try to find it later"); `best-effort-atomic-scale-up.autoscaling.x-k8s.io` adds every node the request needs
from its one node group, or none, and sets Provisioned=True (CapacityIsProvisioned), or Provisioned=False
(CapacityIsNotFound) when the group's `max_nodes` would be passed. With the parameter `noRetry: "true"` a request it
cannot satisfy gets Failed=True (CapacityIsNotFound) instead. Scale-down: `scale_down()` deletes the nodes of its
group that no pod uses and that do not carry `cluster-autoscaler.kubernetes.io/scale-down-disabled: "true"`.

Not emulated: node groups of several shapes, expansion options and their costs, booking expiry
(BookingExpired after 10 minutes), CapacityRevoked, the scale-up's delay, pods consuming a booking (the
`consume-provisioning-request` annotation is not read), scale-down of nodes with movable pods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .resources import NODES, POD_TEMPLATES, PODS, PROVISIONING_REQUESTS
from .store import Store

CHECK_CAPACITY = "check-capacity.autoscaling.x-k8s.io"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
SCALE_DOWN_DISABLED = "cluster-autoscaler.kubernetes.io/scale-down-disabled"


def _gpus(template: dict[str, Any]) -> int:
    total = 0
    for c in (template.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        total += int((res.get("limits") or res.get("requests") or {}).get("nvidia.com/gpu", 0))
    return total


@dataclass
class FakeAutoscaler:
    """One node group: nodes of `gpus` GPUs of `gpu_product`, named `<prefix>-<n>`, at most `max_nodes` in all."""

    cluster: Any  # FakeCluster (its add_node)
    gpus: int
    gpu_product: str
    max_nodes: int
    prefix: str = "scaled"
    labels: dict[str, str] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    @property
    def store(self) -> Store:
        store: Store = self.cluster.store
        return store

    def reconcile(self) -> bool:
        changed = False
        for pr in self.store.list(PROVISIONING_REQUESTS):
            conds = (pr.get("status") or {}).get("conditions") or []
            if any(c.get("status") == "True" and c.get("type") in ("Provisioned", "Failed") for c in conds):
                continue
            changed = self._answer(pr, conds) or changed
        return changed

    def _pods(self, pr: dict[str, Any]) -> list[int] | None:
        """GPUs of every pod the request asks for; None when a PodTemplate is missing."""
        out: list[int] = []
        ns = pr["metadata"]["namespace"]
        for ps in (pr.get("spec") or {}).get("podSets") or []:
            tmpl = self.store.find(POD_TEMPLATES, ns, ps["podTemplateRef"]["name"])
            if tmpl is None:
                return None
            out += [_gpus(tmpl.get("template") or {})] * int(ps.get("count", 1))
        return out

    def _free(self) -> list[int]:
        """Free GPUs per ready node of the group's product."""
        used: dict[str, int] = {}
        for pod in self.store.list(PODS):
            node = (pod.get("spec") or {}).get("nodeName")
            if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                used[node] = used.get(node, 0) + _gpus(pod)
        free = []
        for node in self.store.list(NODES):
            labels = node["metadata"].get("labels") or {}
            if labels.get("nvidia.com/gpu.product") != self.gpu_product:
                continue
            total = int((node.get("status") or {}).get("allocatable", {}).get("nvidia.com/gpu", 0))
            free.append(total - used.get(node["metadata"]["name"], 0))
        return free

    @staticmethod
    def _fits(pods: list[int], free: list[int]) -> list[int]:
        """First-fit, largest pod first: the pods left over."""
        room = sorted(free, reverse=True)
        left = []
        for need in sorted(pods, reverse=True):
            for i, r in enumerate(room):
                if r >= need:
                    room[i] -= need
                    break
            else:
                left.append(need)
        return left

    def _answer(self, pr: dict[str, Any], conds: list[dict[str, Any]]) -> bool:
        pods = self._pods(pr)
        if pods is None:
            return False  # its templates are created first; the next round sees them
        spec = pr.get("spec") or {}
        no_retry = (spec.get("parameters") or {}).get("noRetry") == "true"
        left = self._fits(pods, self._free())
        if spec.get("provisioningClassName") == ATOMIC and left:
            needed = self._nodes_for(left)
            existing = sum(1 for n in self.store.list(NODES) if n["metadata"]["name"].startswith(self.prefix + "-"))
            if existing + needed <= self.max_nodes:
                for _ in range(needed):
                    name = f"{self.prefix}-{len(self.added) + 1}"
                    self.cluster.add_node(name, gpus=self.gpus, gpu_product=self.gpu_product, labels=self.labels)
                    self.added.append(name)
                return self._set(pr, "Provisioned", "True", "CapacityIsProvisioned",
                                 "Capacity is found, CA will provision it.")
        elif spec.get("provisioningClassName") in (ATOMIC, CHECK_CAPACITY) and not left:
            return self._set(pr, "Provisioned", "True", "CapacityIsFound", "Capacity is found in the cluster")
        elif spec.get("provisioningClassName") not in (ATOMIC, CHECK_CAPACITY):
            return self._set(pr, "Failed", "True", "ProvisioningClassNotSupported",
                             f"provisioning class {spec.get('provisioningClassName')} is not supported")
        if no_retry:
            return self._set(pr, "Failed", "True", "CapacityIsNotFound", "CA could not find requested capacity")
        if any(c.get("type") == "Provisioned" and c.get("reason") == "CapacityIsNotFound" for c in conds):
            return False
        return self._set(pr, "Provisioned", "False", "CapacityIsNotFound",
                         "Capacity is not found, CA will try to find it later.")

    def _nodes_for(self, pods: list[int]) -> int:
        nodes: list[int] = []
        for need in sorted(pods, reverse=True):
            for i, r in enumerate(nodes):
                if r >= need:
                    nodes[i] -= need
                    break
            else:
                nodes.append(self.gpus - need)
        return len(nodes)

    def _set(self, pr: dict[str, Any], kind: str, status: str, reason: str, message: str) -> bool:
        stamp = self.cluster.clock.stamp()

        def change(obj: dict[str, Any]) -> None:
            conds = [c for c in (obj.setdefault("status", {}).get("conditions") or []) if c.get("type") != kind]
            if not any(c.get("type") == "Accepted" for c in conds):
                conds.append({"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
                              "lastTransitionTime": stamp})
            conds.append({"type": kind, "status": status, "reason": reason, "message": message,
                          "lastTransitionTime": stamp})
            obj["status"]["conditions"] = conds

        self.store.mutate(PROVISIONING_REQUESTS, pr["metadata"]["namespace"], pr["metadata"]["name"], change)
        return True

    def scale_down(self) -> list[str]:
        """Delete the group's nodes no pod is bound to and that are not kept from scale-down; their names."""
        bound = {(p.get("spec") or {}).get("nodeName") for p in self.store.list(PODS)
                 if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")}
        gone = []
        for node in self.store.list(NODES):
            name = node["metadata"]["name"]
            kept = (node["metadata"].get("annotations") or {}).get(SCALE_DOWN_DISABLED) == "true"
            if name.startswith(self.prefix + "-") and name not in bound and not kept:
                self.store.delete(NODES, None, name)
                gone.append(name)
        self.removed += gone
        return gone
