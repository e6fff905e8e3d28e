"""A kube-scheduler stand-in: binds each ungated pending pod to the first feasible node by name.

Filters as kube-scheduler's default plugins do for what gpuq relies on: scheduling gates (SchedulingGated),
node unschedulable, nodeSelector and required node affinity, NoSchedule/NoExecute taints against tolerations,
and resources (cpu, memory, pods, nvidia.com/gpu, nvidia.com/mig-*, any extended resource) against allocatable
minus the requests of the pods already bound there. No scoring, no preemption, no pod affinity, no topology spread.

Dynamic Resource Allocation: a pod's ResourceClaims must exist and be allocated already (status.allocation, written
by whoever allocated them: gpuq), and the node must match each allocation's nodeSelector; binding the pod reserves
its claims for it (status.reservedFor). The fake never allocates devices itself: a pod whose claim nobody allocated
stays Unschedulable."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from lightkube.utils.quantity import parse_quantity

from .resources import NODES, PODS, RESOURCE_CLAIMS
from .selectors import labels_match
from .store import TERMINAL_POD_PHASES, Obj, Store, set_condition

SCHEDULER_NAME = "default-scheduler"
GATED_MESSAGE = "Scheduling is blocked due to non-empty scheduling gates"


def pod_requests(pod: Obj) -> dict[str, Decimal]:
    """Effective requests: the sum over containers, at least the largest init container, plus overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for name, quantity in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = total.get(name, Decimal(0)) + (parse_quantity(str(quantity)) or Decimal(0))
    for container in spec.get("initContainers") or []:
        for name, quantity in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = max(total.get(name, Decimal(0)), parse_quantity(str(quantity)) or Decimal(0))
    for name, quantity in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, Decimal(0)) + (parse_quantity(str(quantity)) or Decimal(0))
    return total


def tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint.get("key"):
                return True
        elif toleration.get("key") == taint.get("key") and (toleration.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def _expression_matches(expression: Obj, labels: Mapping[str, str]) -> bool:
    key, op, values = expression["key"], expression["operator"], expression.get("values") or []
    if op in ("Gt", "Lt"):
        if key not in labels:
            return False
        try:
            actual, bound = int(labels[key]), int(values[0])
        except (ValueError, IndexError):
            return False
        return actual > bound if op == "Gt" else actual < bound
    mapped = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}[op]
    return labels_match([(key, mapped, tuple(values))], labels)


def node_affinity_matches(pod: Obj, node: Obj) -> bool:
    spec = pod.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    for term in terms:  # terms are ORed, expressions within a term ANDed
        expressions = term.get("matchExpressions") or []
        fields = term.get("matchFields") or []
        name_ok = all(_expression_matches(f, {"metadata.name": node["metadata"]["name"]}) for f in fields)
        if name_ok and all(_expression_matches(e, labels) for e in expressions):
            return True
    return False


def node_ready(node: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or []
    )


class FakeScheduler:
    def __init__(self, store: Store) -> None:
        self.store = store

    def reconcile(self) -> bool:
        before = self.store.resource_version
        nodes = self.store.list(NODES)
        used = self._usage()
        pending = [
            pod
            for pod in self.store.list(PODS)
            if not pod["spec"].get("nodeName")
            and not pod["metadata"].get("deletionTimestamp")
            and pod["status"].get("phase") == "Pending"
            and pod["spec"].get("schedulerName", SCHEDULER_NAME) == SCHEDULER_NAME
        ]
        pending.sort(
            key=lambda p: (
                -int(p["spec"].get("priority") or 0),
                p["metadata"]["creationTimestamp"],
                p["metadata"]["namespace"],
                p["metadata"]["name"],
            )
        )
        for pod in pending:
            meta = pod["metadata"]
            if pod["spec"].get("schedulingGates"):
                self._condition(pod, "SchedulingGated", GATED_MESSAGE)
                continue
            node, reasons = self._fit(pod, nodes, used)
            if node is None:
                summary = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
                self._condition(pod, "Unschedulable", f"0/{len(nodes)} nodes are available: {summary}.")
                continue
            self.store.bind(meta["namespace"], meta["name"], node)
            self._reserve(pod)
            used.setdefault(node, Counter()).update(pod_requests(pod))
            used[node]["pods"] += 1
        return self.store.resource_version != before

    def _claims(self, pod: Obj) -> list[tuple[str, Obj | None]]:
        """(name, claim or None when it does not exist yet) of each ResourceClaim the pod names."""
        made = {s.get("name"): s.get("resourceClaimName") for s in pod["status"].get("resourceClaimStatuses") or []}
        out = []
        for ref in pod["spec"].get("resourceClaims") or []:
            name = ref.get("resourceClaimName") or made.get(ref.get("name"))
            claim = self.store.find(RESOURCE_CLAIMS, pod["metadata"]["namespace"], name) if name else None
            out.append((name or ref.get("name") or "?", claim))
        return out

    def _claims_reject(self, pod: Obj, node: Obj) -> str | None:
        for name, claim in self._claims(pod):
            if claim is None:
                return f"pod's resource claim {name} does not exist yet"
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                return f"resource claim {name} is not allocated (the fake allocates no device itself)"
            selector = allocation.get("nodeSelector")
            required = {"requiredDuringSchedulingIgnoredDuringExecution": selector}
            if selector and not node_affinity_matches({"spec": {"affinity": {"nodeAffinity": required}}}, node):
                return f"node(s) didn't match the allocation of resource claim {name}"
        return None

    def _reserve(self, pod: Obj) -> None:
        meta = pod["metadata"]
        consumer = {"resource": "pods", "name": meta["name"], "uid": meta["uid"]}
        for _, claim in self._claims(pod):
            if claim is None:
                continue

            def reserve(c: Obj) -> None:
                reserved = c.setdefault("status", {}).setdefault("reservedFor", [])
                if consumer not in reserved:
                    reserved.append(consumer)

            self.store.mutate(RESOURCE_CLAIMS, meta["namespace"], claim["metadata"]["name"], reserve)

    def _condition(self, pod: Obj, reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = self.store.clock.stamp()
        self.store.mutate(
            PODS,
            meta["namespace"],
            meta["name"],
            lambda p: set_condition(p, "PodScheduled", "False", reason, message, now),
        )

    def _usage(self) -> dict[str, Counter[str]]:
        used: dict[str, Counter[str]] = {}
        for pod in self.store.list(PODS):
            node = pod["spec"].get("nodeName")
            if node and pod["status"].get("phase") not in TERMINAL_POD_PHASES:
                counter = used.setdefault(node, Counter())
                counter.update(pod_requests(pod))
                counter["pods"] += 1
        return used

    def _fit(self, pod: Obj, nodes: list[Obj], used: dict[str, Counter[str]]) -> tuple[str | None, Counter[str]]:
        reasons: Counter[str] = Counter()
        requests = pod_requests(pod)
        tolerations = pod["spec"].get("tolerations") or []
        for node in nodes:
            reason = self._reject(node, requests, tolerations, pod, used.get(node["metadata"]["name"], Counter()))
            if reason is None:
                return node["metadata"]["name"], reasons
            reasons[reason] += 1
        return None, reasons

    def _reject(
        self, node: Obj, requests: dict[str, Decimal], tolerations: list[Obj], pod: Obj, used: Counter[str]
    ) -> str | None:
        if (node.get("spec") or {}).get("unschedulable"):
            return "node(s) were unschedulable"
        if not node_affinity_matches(pod, node):
            return "node(s) didn't match Pod's node affinity/selector"
        if pod["spec"].get("resourceClaims"):
            claims = self._claims_reject(pod, node)
            if claims is not None:
                return claims
        for taint in (node.get("spec") or {}).get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
                return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"
        allocatable: dict[str, Any] = (
            (node.get("status") or {}).get("allocatable") or (node.get("status") or {}).get("capacity") or {}
        )
        pods_cap = parse_quantity(str(allocatable.get("pods", "110"))) or Decimal(0)
        if used["pods"] + 1 > pods_cap:
            return "Too many pods"
        for name, amount in sorted(requests.items()):
            if amount <= 0:
                continue
            capacity = parse_quantity(str(allocatable[name])) if name in allocatable else Decimal(0)
            if used[name] + amount > (capacity or Decimal(0)):
                return f"Insufficient {name}"
        return None
