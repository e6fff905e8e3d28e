"""The fake API server's state: objects, a cluster-wide monotonic resourceVersion, and the change history that
watches resume from.

Everything here is synchronous: one mutation runs to completion inside the event loop, so no lock is needed and
every watcher sees changes in resourceVersion order. Watches receive their events through an asyncio.Queue
(`put_nowait` is safe from synchronous code)."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .clock import FakeClock, parse_time
from .errors import KubernetesError, already_exists, bad_request, conflict, gone, invalid, not_found, status_body
from .events import core_from_new, new_from_core
from .patch import apply_patch
from .resources import (
    ALL_RESOURCES,
    CRDS,
    CUSTOM_RESOURCES,
    EVENTS,
    JOBS,
    NAMESPACES,
    NEW_EVENTS,
    PODS,
    ResourceType,
    crd_object,
    default_object,
    validate_create,
    validate_update,
)

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "" for cluster-scoped, name)
Matcher = Callable[[Obj], bool]

TERMINAL_POD_PHASES = ("Succeeded", "Failed")
EVENT_VIEWS = (EVENTS, NEW_EVENTS)
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class Change:
    """One committed change, as the history keeps it for watch replay."""

    rv: int
    resource: ResourceType
    type: str  # ADDED | MODIFIED | DELETED
    obj: Obj
    prev: Obj | None


class WatchStream:
    """One open watch: a queue of watch events (dicts) ended by None."""

    def __init__(self, resource: ResourceType, namespace: str | None, matches: Matcher, bookmarks: bool) -> None:
        self.resource = resource
        self.namespace = namespace
        self.matches = matches
        self.bookmarks = bookmarks
        self.queue: asyncio.Queue[Obj | None] = asyncio.Queue()
        self.closed = False

    def _visible(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return self.matches(obj)

    def offer(self, change: Change) -> None:
        """Translate a change for this watch's selectors: an object that starts (stops) matching is ADDED
        (DELETED) for this watcher, as kube-apiserver's watch cache does."""
        if self.closed or change.resource is not self.resource:
            return
        now, before = self._visible(change.obj), self._visible(change.prev)
        if change.type == "ADDED":
            event_type = "ADDED" if now else None
        elif change.type == "DELETED":
            event_type = "DELETED" if before or now else None
        elif now and before:
            event_type = "MODIFIED"
        elif now:
            event_type = "ADDED"
        elif before:
            event_type = "DELETED"
        else:
            event_type = None
        if event_type:
            self.queue.put_nowait({"type": event_type, "object": copy.deepcopy(change.obj)})

    def bookmark(self, rv: int, annotations: dict[str, str] | None = None) -> None:
        if self.closed or not self.bookmarks:
            return
        metadata: Obj = {"resourceVersion": str(rv)}
        if annotations:
            metadata["annotations"] = annotations
        self.queue.put_nowait(
            {
                "type": "BOOKMARK",
                "object": {"apiVersion": self.resource.api_version, "kind": self.resource.kind, "metadata": metadata},
            }
        )

    def close(self, error: Obj | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if error is not None:
            self.queue.put_nowait({"type": "ERROR", "object": error})
        self.queue.put_nowait(None)


class Store:
    def __init__(self, clock: FakeClock | None = None, history_limit: int = 10_000) -> None:
        self.clock = clock or FakeClock()
        self._rv = 0
        self._objects: dict[ResourceType, dict[Key, Obj]] = {resource: {} for resource in ALL_RESOURCES}
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._floor = 0  # the history holds every change with rv > floor
        self._watches: set[WatchStream] = set()
        self._listeners: list[Callable[[Change], None]] = []
        self._propagation: dict[tuple[ResourceType, Key], str] = {}  # how a pending deletion treats dependents
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(NAMESPACES, None, {"metadata": {"name": name}})
        for resource in CUSTOM_RESOURCES:
            self.create(CRDS, None, crd_object(resource))

    # --- reading -------------------------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    def get(self, resource: ResourceType, namespace: str | None, name: str) -> Obj:
        return copy.deepcopy(self._get(resource, namespace, name))

    def find(self, resource: ResourceType, namespace: str | None, name: str) -> Obj | None:
        obj = self._objects[resource].get(self._key(resource, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, resource: ResourceType, namespace: str | None = None, matches: Matcher | None = None) -> list[Obj]:
        """Matching objects sorted by (namespace, name), as the real server (etcd key order) lists them."""
        items = []
        for (ns, _), obj in sorted(self._objects[resource].items()):
            if namespace is not None and resource.namespaced and ns != namespace:
                continue
            if matches is None or matches(obj):
                items.append(copy.deepcopy(obj))
        return items

    def _key(self, resource: ResourceType, namespace: str | None, name: str) -> Key:
        return (namespace or "", name) if resource.namespaced else ("", name)

    def _get(self, resource: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._objects[resource].get(self._key(resource, namespace, name))
        if obj is None:
            raise not_found(resource.plural, name, resource.group)
        return obj

    # --- writing -------------------------------------------------------------------------------------------------

    def create(self, resource: ResourceType, namespace: str | None, body: Obj, *, dry_run: bool = False) -> Obj:
        obj = copy.deepcopy(body)
        if not isinstance(obj, dict):
            raise bad_request(f"the body of a {resource.kind} must be a JSON object")
        self._check_type(resource, obj)
        metadata = obj.setdefault("metadata", {})
        if not metadata.get("name"):
            if metadata.get("generateName"):
                metadata["name"] = f"{metadata['generateName']}{uuid.uuid4().hex[:5]}"
            else:
                raise invalid(resource.kind, "", "metadata.name: Required value: name or generateName is required")
        name = metadata["name"]
        if resource.namespaced:
            body_ns = metadata.get("namespace")
            if namespace and body_ns and body_ns != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            namespace = namespace or body_ns or "default"
            metadata["namespace"] = namespace
            self._check_namespace_open(namespace)
        else:
            metadata.pop("namespace", None)
        key = self._key(resource, namespace, name)
        if key in self._objects[resource]:
            raise already_exists(resource.plural, name, resource.group)
        for server_field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            metadata.pop(server_field, None)
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = self.clock.stamp()
        metadata["generation"] = 1
        default_object(resource, obj)
        validate_create(resource, obj)
        if dry_run:
            return obj
        return self._commit(resource, key, obj, None)

    def replace(
        self, resource: ResourceType, namespace: str | None, name: str, body: Obj, subresource: str | None = None,
        *, dry_run: bool = False,
    ) -> Obj:
        """PUT: optimistic concurrency on metadata.resourceVersion (when given), as the real server."""
        if not isinstance(body, dict):
            raise bad_request(f"the body of a {resource.kind} must be a JSON object")
        self._check_type(resource, body)
        old = self._get(resource, namespace, name)
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
        self._check_precondition(resource, old, body)
        return self._client_write(resource, old, copy.deepcopy(body), subresource, dry_run=dry_run)

    def patch(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
        *,
        create_missing: bool = False,
        dry_run: bool = False,
    ) -> Obj:
        current = self.find(resource, namespace, name)
        if current is None:
            if not create_missing:
                raise not_found(resource.plural, name, resource.group)
            body = apply_patch({}, patch, content_type, resource.kind, name, resource.custom)
            body.setdefault("metadata", {})["name"] = name
            return self.create(resource, namespace, body, dry_run=dry_run)
        patched = apply_patch(current, patch, content_type, resource.kind, name, resource.custom)
        if not isinstance(patched, dict):
            raise bad_request("the patch did not produce an object")
        if isinstance(patch, dict) and (patch.get("metadata") or {}).get("resourceVersion"):
            self._check_precondition(resource, current, patch)
        return self._client_write(resource, self._get(resource, namespace, name), patched, subresource, dry_run=dry_run)

    def _client_write(
        self, resource: ResourceType, old: Obj, new: Obj, subresource: str | None, *, dry_run: bool = False
    ) -> Obj:
        new = self._carry_server_fields(old, new)
        if subresource == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            new = merged
        elif subresource is not None:
            raise bad_request(f"subresource {subresource!r} of {resource} cannot be written this way")
        else:
            if "status" in resource.subresources:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            validate_update(resource, old, new)
        if dry_run:  # what the write would store (admission sees it before it is stored)
            return copy.deepcopy(new)
        return self._update(resource, old, new)

    def _carry_server_fields(self, old: Obj, new: Obj) -> Obj:
        """Fields a client cannot change: identity, timestamps, deletion state."""
        new.setdefault("metadata", {})
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        for server_field in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if server_field in old["metadata"]:
                new["metadata"][server_field] = old["metadata"][server_field]
            else:
                new["metadata"].pop(server_field, None)
        return new

    def _check_precondition(self, resource: ResourceType, old: Obj, body: Obj) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and str(wanted) != old["metadata"]["resourceVersion"]:
            raise conflict(
                resource.plural,
                old["metadata"]["name"],
                "the object has been modified; please apply your changes to the latest version and try again",
                resource.group,
            )

    def _check_type(self, resource: ResourceType, obj: Obj) -> None:
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if (api_version and api_version != resource.api_version) or (kind and kind != resource.kind):
            raise bad_request(
                f"the API version in the data ({api_version}) or kind ({kind}) does not match the expected "
                f"API version ({resource.api_version}) and kind ({resource.kind})"
            )
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind

    def _check_namespace_open(self, namespace: str) -> None:
        ns = self._objects[NAMESPACES].get(("", namespace))
        if ns is None:
            raise not_found("namespaces", namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise KubernetesError(
                status=403,
                reason="Forbidden",
                message=f"unable to create new content in namespace {namespace} because it is being terminated",
                details={"name": namespace, "kind": "namespaces"},
            )

    def mutate(self, resource: ResourceType, namespace: str | None, name: str, change: Callable[[Obj], None]) -> Obj:
        """A privileged read-modify-write for the fake's own actors (kubelet, scheduler, controllers): no
        precondition and no client validation, like a controller writing through its own status subresource."""
        old = self._get(resource, namespace, name)
        new = copy.deepcopy(old)
        change(new)
        return self._update(resource, old, new)

    def _update(self, resource: ResourceType, old: Obj, new: Obj) -> Obj:
        if new == old:
            return copy.deepcopy(old)  # a no-op write does not move resourceVersion, as in the real server
        if _spec_part(old) != _spec_part(new):
            new["metadata"]["generation"] = int(old["metadata"].get("generation") or 1) + 1
        key = self._key(resource, old["metadata"].get("namespace"), old["metadata"]["name"])
        committed = self._commit(resource, key, new, old)
        self._finish_if_released(resource, key)
        return self.find(resource, key[0], key[1]) or committed

    def _commit(self, resource: ResourceType, key: Key, obj: Obj, prev: Obj | None) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[resource][key] = obj
        self._emit(Change(self._rv, resource, "ADDED" if prev is None else "MODIFIED", copy.deepcopy(obj), prev))
        self._mirror_event(resource, key, obj)
        return copy.deepcopy(obj)

    def _mirror_event(self, resource: ResourceType, key: Key, obj: Obj | None) -> None:
        """core/v1 and events.k8s.io/v1 Events are one object seen two ways: keep the other view in step, with the
        same resourceVersion."""
        if resource not in EVENT_VIEWS:
            return
        other = NEW_EVENTS if resource is EVENTS else EVENTS
        previous = self._objects[other].get(key)
        if obj is None:
            if previous is not None:
                del self._objects[other][key]
                final = copy.deepcopy(previous)
                final["metadata"]["resourceVersion"] = str(self._rv)
                self._emit(Change(self._rv, other, "DELETED", final, previous))
            return
        mirrored = new_from_core(obj) if resource is EVENTS else core_from_new(obj)
        self._objects[other][key] = mirrored
        self._emit(
            Change(self._rv, other, "ADDED" if previous is None else "MODIFIED", copy.deepcopy(mirrored), previous)
        )

    def _remove(self, resource: ResourceType, key: Key, propagation: str | None = None) -> Obj:
        prev = self._objects[resource].pop(key)
        propagation = self._propagation.pop((resource, key), propagation)
        self._rv += 1
        final = copy.deepcopy(prev)
        final["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(Change(self._rv, resource, "DELETED", final, prev))
        self._mirror_event(resource, key, None)
        self._collect_dependents(resource, final, propagation)
        if resource.namespaced:
            self._finish_namespace_if_empty(key[0])
        return final

    # --- deletion ------------------------------------------------------------------------------------------------

    def delete(
        self,
        resource: ResourceType,
        namespace: str | None,
        name: str,
        *,
        grace_period_s: int | None = None,
        propagation: str | None = None,
        precondition_uid: str | None = None,
        precondition_rv: str | None = None,
    ) -> Obj:
        """Graceful deletion: a bound, running pod gets deletionTimestamp = now + grace and stays until the kubelet
        (or a later delete with grace 0) finishes it; finalizers hold any object until they are removed."""
        key = self._key(resource, namespace, name)
        obj = self._get(resource, namespace, name)
        if precondition_uid and obj["metadata"]["uid"] != precondition_uid:
            raise conflict(
                resource.plural,
                name,
                f"Precondition failed: UID in precondition: {precondition_uid}, "
                f"UID in object meta: {obj['metadata']['uid']}",
                resource.group,
            )
        if precondition_rv and obj["metadata"]["resourceVersion"] != precondition_rv:
            raise conflict(
                resource.plural,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
                resource.group,
            )
        if propagation not in (None, "Orphan", "Background", "Foreground"):
            raise bad_request(f"unsupported propagationPolicy: {propagation}")
        if propagation is None and resource is JOBS:
            propagation = "Orphan"  # batch/v1 Jobs orphan their pods unless told otherwise, as in the real API
        grace = self._grace_period(resource, obj, grace_period_s)
        metadata = obj["metadata"]
        if metadata.get("deletionTimestamp"):
            remaining = int(metadata.get("deletionGracePeriodSeconds") or 0)
            if grace >= remaining:
                return copy.deepcopy(obj)  # a longer grace period never extends a deletion already under way
        new = copy.deepcopy(obj)
        new["metadata"]["deletionTimestamp"] = self.clock.stamp(grace)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        if propagation:
            self._propagation[(resource, key)] = propagation
        if resource is NAMESPACES:
            new.setdefault("status", {})["phase"] = "Terminating"
        if grace == 0 and not new["metadata"].get("finalizers") and resource is not NAMESPACES:
            return self._remove(resource, key, propagation)
        updated = self._update(resource, obj, new)
        if resource is NAMESPACES:
            self._empty_namespace(name)
        return updated

    def _grace_period(self, resource: ResourceType, obj: Obj, requested: int | None) -> int:
        if resource is not PODS:
            return 0
        if not (obj.get("spec") or {}).get("nodeName") or (obj.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
            return 0  # an unscheduled or finished pod has nothing to stop: deleted at once
        if requested is not None:
            return max(0, int(requested))
        return int((obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30))

    def _finish_if_released(self, resource: ResourceType, key: Key) -> None:
        obj = self._objects[resource].get(key)
        if obj is None or resource is NAMESPACES:
            return
        metadata = obj["metadata"]
        if (
            metadata.get("deletionTimestamp")
            and not metadata.get("finalizers")
            and not metadata.get("deletionGracePeriodSeconds")
        ):
            self._remove(resource, key, self._propagation.get((resource, key)))

    def _collect_dependents(self, owner_resource: ResourceType, owner: Obj, propagation: str | None) -> None:
        """The garbage collector: dependents of a removed owner are deleted (Background; Foreground is treated the
        same) or released from the owner (Orphan)."""
        uid = owner["metadata"]["uid"]
        for resource in ALL_RESOURCES:
            for key, obj in sorted(self._objects[resource].items()):
                refs = obj["metadata"].get("ownerReferences") or []
                if not any(ref.get("uid") == uid for ref in refs):
                    continue
                if propagation == "Orphan":
                    self.mutate(
                        resource,
                        key[0],
                        key[1],
                        lambda o: o["metadata"].__setitem__(
                            "ownerReferences",
                            [r for r in o["metadata"].get("ownerReferences") or [] if r.get("uid") != uid],
                        ),
                    )
                elif key in self._objects[resource]:
                    self.delete(resource, key[0] or None, key[1], propagation="Background")

    def _empty_namespace(self, namespace: str) -> None:
        for resource in ALL_RESOURCES:
            if not resource.namespaced:
                continue
            for key in sorted(self._objects[resource]):
                if key[0] == namespace and key in self._objects[resource]:
                    self.delete(resource, namespace, key[1], propagation="Background")
        self._finish_namespace_if_empty(namespace)

    def _finish_namespace_if_empty(self, namespace: str) -> None:
        ns = self._objects[NAMESPACES].get(("", namespace))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(key[0] == namespace for r in ALL_RESOURCES if r.namespaced for key in self._objects[r]):
            return
        self._remove(NAMESPACES, ("", namespace))

    def finish_deletion(self, resource: ResourceType, namespace: str | None, name: str) -> None:
        """What the kubelet does once a terminating pod's containers stopped: the final delete with grace 0."""
        key = self._key(resource, namespace, name)
        obj = self._objects[resource].get(key)
        if obj is None or not obj["metadata"].get("deletionTimestamp"):
            return
        self.mutate(resource, namespace, name, lambda o: o["metadata"].__setitem__("deletionGracePeriodSeconds", 0))
        self._finish_if_released(resource, key)

    def expired_deletions(self, resource: ResourceType) -> list[Obj]:
        """Terminating objects whose grace period is over (the kubelet kills them then)."""
        now = self.clock.now()
        return [
            copy.deepcopy(obj)
            for _, obj in sorted(self._objects[resource].items())
            if obj["metadata"].get("deletionTimestamp") and parse_time(obj["metadata"]["deletionTimestamp"]) <= now
        ]

    # --- pods/binding --------------------------------------------------------------------------------------------

    def bind(self, namespace: str, name: str, node: str) -> None:
        pod = self._get(PODS, namespace, name)
        if pod["metadata"].get("deletionTimestamp"):
            raise conflict("pods", name, "pod is being deleted, cannot be assigned to a host")
        if pod["spec"].get("nodeName"):
            raise conflict("pods", name, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        if pod["spec"].get("schedulingGates"):
            raise conflict("pods", name, f"pod {name} has non-empty .spec.schedulingGates")

        def assign(obj: Obj) -> None:
            obj["spec"]["nodeName"] = node
            set_condition(obj, "PodScheduled", "True", None, None, self.clock.stamp())

        self.mutate(PODS, namespace, name, assign)

    # --- change feed ---------------------------------------------------------------------------------------------

    def _emit(self, change: Change) -> None:
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self._floor = self._history.popleft().rv
        for watch in list(self._watches):
            watch.offer(change)
        for listener in list(self._listeners):
            listener(change)

    def subscribe(self, listener: Callable[[Change], None]) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def watch(
        self,
        resource: ResourceType,
        namespace: str | None,
        matches: Matcher,
        since_rv: int | None,
        *,
        bookmarks: bool = False,
        send_initial_events: bool = False,
    ) -> WatchStream:
        """Open a watch. From no or "0" resourceVersion: the current objects as ADDED first; from a resourceVersion
        the history still holds: the changes after it; older: 410 Gone (the caller must relist)."""
        stream = WatchStream(resource, namespace if resource.namespaced else None, matches, bookmarks)
        if since_rv is None or since_rv == 0 or send_initial_events:
            for obj in self.list(resource, namespace if resource.namespaced else None, matches):
                stream.queue.put_nowait({"type": "ADDED", "object": obj})
            if send_initial_events:
                stream.bookmark(self._rv, {INITIAL_EVENTS_END: "true"})
        else:
            if since_rv < self._floor:
                raise gone(f"too old resource version: {since_rv} ({self._floor + 1})")
            for change in self._history:
                if change.rv > since_rv:
                    stream.offer(change)
        self._watches.add(stream)
        return stream

    def stop_watch(self, stream: WatchStream) -> None:
        stream.close()
        self._watches.discard(stream)

    def bookmark(self) -> None:
        """Send a BOOKMARK (current resourceVersion) to every watch that allows bookmarks. The real server does this
        about once a minute; here a test decides when."""
        for watch in list(self._watches):
            watch.bookmark(self._rv)

    def compact(self, *, expire_watches: bool = True) -> int:
        """Forget the history up to now, as an etcd compaction does: resuming a watch from an older resourceVersion
        then gets 410 Gone. With expire_watches, open watches are also ended with a 410 ERROR event (as when the
        watch cache drops a watcher that fell behind), so clients must resume, get 410, and relist."""
        self._history.clear()
        self._floor = self._rv
        if expire_watches:
            for watch in list(self._watches):
                watch.close(status_body(gone(f"too old resource version: compacted at {self._rv}")))
                self._watches.discard(watch)
        return self._rv

    def close_all_watches(self) -> None:
        for watch in list(self._watches):
            self.stop_watch(watch)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def all_objects(self) -> Iterator[tuple[ResourceType, Obj]]:
        for resource in ALL_RESOURCES:
            for _, obj in sorted(self._objects[resource].items()):
                yield resource, copy.deepcopy(obj)


def _spec_part(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def set_condition(obj: Obj, kind: str, status: str, reason: str | None, message: str | None, now: str) -> bool:
    """Set a status condition the way controllers do: lastTransitionTime moves only when the status changes.
    Returns whether anything changed."""
    conditions = obj.setdefault("status", {}).setdefault("conditions", [])
    for condition in conditions:
        if condition.get("type") == kind:
            changed = (
                condition.get("status") != status
                or condition.get("reason") != reason
                or condition.get("message") != message
            )
            if condition.get("status") != status:
                condition["lastTransitionTime"] = now
            condition["status"] = status
            _set_or_drop(condition, "reason", reason)
            _set_or_drop(condition, "message", message)
            return changed
    condition = {"type": kind, "status": status, "lastTransitionTime": now}
    _set_or_drop(condition, "reason", reason)
    _set_or_drop(condition, "message", message)
    conditions.append(condition)
    return True


def _set_or_drop(target: Obj, key: str, value: Any) -> None:
    if value is None:
        target.pop(key, None)
    else:
        target[key] = value


def get_condition(obj: Obj, kind: str) -> Obj | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)
