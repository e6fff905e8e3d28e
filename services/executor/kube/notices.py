"""Answers where users look: Kubernetes Events on the workload and its `gpuq.io/status` annotation, so that
`kubectl describe` says why a job waits, where it stands and when it should start.

Both are best effort: a failed Event never fails the unit of work that decided something (the decision is in
Postgres and on the bus already)."""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from typing import Any

from services.core.kube.kinds import kind_of
from services.core.kube.names import STATUS_ANNOTATION
from services.executor.kube.client import EVENT, POD, KubeApi, workload_resource

log = logging.getLogger("gpuq.executor.kube")
COMPONENT = "gpuq"
MAX_MESSAGE = 1024


def _ts(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_object(ref: dict[str, Any], reason: str, message: str, now: float, *, warning: bool = False,
                 instance: str = "") -> dict[str, Any]:
    """A core/v1 Event about `ref` (apiVersion, kind, namespace, name, uid)."""
    digest = hashlib.blake2b(f"{reason}|{message}|{now}".encode(), digest_size=6).hexdigest()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{ref['name']}.{digest}", "namespace": ref["namespace"]},
        "involvedObject": {k: v for k, v in ref.items() if v is not None},
        "reason": reason, "message": message[:MAX_MESSAGE], "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT}, "reportingComponent": COMPONENT, "reportingInstance": instance,
        "firstTimestamp": _ts(now), "lastTimestamp": _ts(now), "count": 1,
    }


class Notices:
    def __init__(self, api: KubeApi, instance: str = ""):
        self.api = api
        self.instance = instance

    async def event(self, ref: dict[str, Any], reason: str, message: str, now: float, *,
                    warning: bool = False) -> None:
        try:
            await self.api.create(EVENT, event_object(ref, reason, message, now, warning=warning,
                                                      instance=self.instance), namespace=ref["namespace"])
        except Exception as exc:
            log.warning("could not post Event %s on %s/%s: %s", reason, ref["namespace"], ref["name"], exc)

    async def status(self, ref: dict[str, Any], text: str) -> None:
        kind = kind_of(ref["apiVersion"], ref["kind"])
        plain_pod = ref["apiVersion"] == "v1" and ref["kind"] == "Pod"  # a plain pod's job (kinds/pod.py)
        if kind is None and not plain_pod:
            return
        try:
            await self.api.patch(POD if kind is None else workload_resource(kind), ref["name"],
                                 {"metadata": {"annotations": {STATUS_ANNOTATION: text[:MAX_MESSAGE]}}},
                                 namespace=ref["namespace"])
        except Exception as exc:
            log.warning("could not set %s on %s/%s: %s", STATUS_ANNOTATION, ref["namespace"], ref["name"], exc)
