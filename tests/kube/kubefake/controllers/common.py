"""What the workload controllers share: owner references, owned objects, pods from templates, status writes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..resources import PODS, ResourceType
from ..store import TERMINAL_POD_PHASES, Obj, Store, set_condition


class WorkloadController:
    """A controller that syncs every live object of one resource per pass; `reconcile()` says whether it changed
    anything (the fake cluster runs its actors until a whole pass changes nothing)."""

    resource: ResourceType

    def __init__(self, store: Store) -> None:
        self.store = store

    def reconcile(self) -> bool:
        before = self.store.resource_version
        self.sync_all()
        return self.store.resource_version != before

    def sync_all(self) -> None:
        for obj in self.store.list(self.resource):
            if not obj["metadata"].get("deletionTimestamp"):
                self.sync(obj)

    def sync(self, obj: Obj) -> None:
        raise NotImplementedError


def owner_reference(owner: Obj) -> Obj:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned(store: Store, resource: ResourceType, owner: Obj) -> list[Obj]:
    """The objects whose controller reference is `owner`, in its namespace."""
    uid = owner["metadata"]["uid"]
    return store.list(
        resource,
        owner["metadata"].get("namespace"),
        lambda o: any(r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or []),
    )


def create_from_template(
    store: Store,
    resource: ResourceType,
    owner: Obj,
    template: Obj,
    *,
    name: str | None = None,
    generate_name: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    finalizers: list[str] | None = None,
    mutate_spec: Callable[[Obj], None] | None = None,
) -> Obj:
    """Create an object (a pod, or a Job for JobSet) from a template (metadata + spec) owned by `owner`."""
    template = copy.deepcopy(template or {})
    metadata = template.get("metadata") or {}
    body: Obj = {
        "metadata": {
            "namespace": owner["metadata"]["namespace"],
            "labels": {**(metadata.get("labels") or {}), **(labels or {})},
            "annotations": {**(metadata.get("annotations") or {}), **(annotations or {})},
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": template.get("spec") or {},
    }
    if name:
        body["metadata"]["name"] = name
    else:
        body["metadata"]["generateName"] = generate_name
    if finalizers:
        body["metadata"]["finalizers"] = list(finalizers)
    if not body["metadata"]["annotations"]:
        del body["metadata"]["annotations"]
    if mutate_spec is not None:
        mutate_spec(body["spec"])
    return store.create(resource, owner["metadata"]["namespace"], body)


def is_active(pod: Obj) -> bool:
    return pod["status"].get("phase") not in TERMINAL_POD_PHASES and not pod["metadata"].get("deletionTimestamp")


def is_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions") or [])


def delete_pods(store: Store, pods: list[Obj]) -> None:
    for pod in pods:
        if not pod["metadata"].get("deletionTimestamp"):
            store.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])


def write_status(store: Store, resource: ResourceType, obj: Obj, change: Callable[[Obj], Any]) -> None:
    """Apply `change` to the object's status (a no-op write does not move resourceVersion)."""
    store.mutate(
        resource,
        obj["metadata"].get("namespace"),
        obj["metadata"]["name"],
        lambda o: change(o.setdefault("status", {})),
    )


def condition_true(obj: Obj, kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or []
    )


def set_status_condition(status: Obj, kind: str, value: str, reason: str | None, message: str | None, now: str) -> None:
    set_condition({"status": status}, kind, value, reason, message, now)


def env_var(container: Obj, name: str, value: str | None = None, field_path: str | None = None) -> None:
    """Add an env var unless the container sets it already (controllers never override the user's env)."""
    env = container.setdefault("env", [])
    if any(e.get("name") == name for e in env):
        return
    if field_path is not None:
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}})
    else:
        env.append({"name": name, "value": value})
