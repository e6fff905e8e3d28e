"""Kubernetes Events: core/v1 and events.k8s.io/v1 are two views of the same objects, as in the real API server (an
Event created through one is read, listed and watched through the other, with the same name, uid and
resourceVersion). The field mapping is the API server's conversion; the create validation is the part of it a
client trips over (events.k8s.io/v1 needs eventTime, reportingController, reportingInstance, action and reason;
an event's involved object must be in the event's namespace)."""

from __future__ import annotations

import copy
from typing import Any

from .errors import invalid

Obj = dict[str, Any]

# (events.k8s.io/v1 field, core/v1 field)
_SAME_NAMES = ("reason", "type", "eventTime", "action", "reportingInstance", "series", "related")
_RENAMED = (
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedCount", "count"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
)


def _convert(source: Obj, api_version: str, pairs: list[tuple[str, str]]) -> Obj:
    converted: Obj = {"apiVersion": api_version, "kind": "Event", "metadata": copy.deepcopy(source["metadata"])}
    for name in _SAME_NAMES:
        if source.get(name) is not None:
            converted[name] = copy.deepcopy(source[name])
    for from_name, to_name in pairs:
        if source.get(from_name) is not None:
            converted[to_name] = copy.deepcopy(source[from_name])
    return converted


def core_from_new(event: Obj) -> Obj:
    core = _convert(event, "v1", list(_RENAMED))
    core.setdefault("involvedObject", {})
    if "reportingComponent" not in core and (event.get("deprecatedSource") or {}).get("component"):
        core["reportingComponent"] = event["deprecatedSource"]["component"]
    return core


def new_from_core(event: Obj) -> Obj:
    new = _convert(event, "events.k8s.io/v1", [(b, a) for a, b in _RENAMED])
    if "reportingController" not in new and (event.get("source") or {}).get("component"):
        new["reportingController"] = event["source"]["component"]
    if "reportingInstance" not in new and (event.get("source") or {}).get("host"):
        new["reportingInstance"] = event["source"]["host"]
    new.setdefault("eventTime", None)  # a core Event without one reads back with eventTime: null, as in the real API
    return new


def validate_new_event(event: Obj) -> None:
    name = event["metadata"].get("name", "")
    missing = [
        f for f in ("eventTime", "reportingController", "reportingInstance", "action", "reason") if not event.get(f)
    ]
    if missing:
        raise invalid("Event", name, ", ".join(f"{field}: Required value" for field in missing), "events.k8s.io")
    _check_namespace(event, event.get("regarding") or {}, "regarding")


def validate_core_event(event: Obj) -> None:
    _check_namespace(event, event.get("involvedObject") or {}, "involvedObject")


def _check_namespace(event: Obj, involved: Obj, field: str) -> None:
    namespace = event["metadata"].get("namespace")
    if involved.get("namespace") and involved["namespace"] != namespace:
        raise invalid(
            "Event",
            event["metadata"].get("name", ""),
            f"{field}.namespace: Invalid value: {involved['namespace']!r}: does not match event.namespace",
        )
