"""The Kubernetes API through lightkube's async client, with every object as a plain dict.

Generic (dict-based) resource classes are built here for every kind the executor touches, without lightkube's
global registry: the pure core works on the API's JSON, so typed models would only be converted back. Errors
are lightkube's `ApiError` (an httpx error carrying the API's Status).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.core.generic_client import ALL_NS
from lightkube.core.resource import ApiInfo
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericNamespacedResource,
    GenericNamespacedStatus,
    create_api_info,
)
from lightkube.types import PatchType

from services.core.kube.workload import WorkloadKind

FIELD_MANAGER = "gpuq-executor"


def _resource(group: str, version: str, kind: str, plural: str, *, namespaced: bool) -> type:
    base = GenericNamespacedResource if namespaced else GenericGlobalResource
    cls = type(kind, (base,), {"_api_info": create_api_info(group, version, kind, plural)})
    return cls


POD = _resource("", "v1", "Pod", "pods", namespaced=True)
NODE = _resource("", "v1", "Node", "nodes", namespaced=False)
EVENT = _resource("", "v1", "Event", "events", namespaced=True)
# The admission webhook's own objects: its certificate's Secret and the configurations whose caBundle it keeps.
SECRET = _resource("", "v1", "Secret", "secrets", namespaced=True)
MUTATING_WEBHOOKS = _resource("admissionregistration.k8s.io", "v1", "MutatingWebhookConfiguration",
                              "mutatingwebhookconfigurations", namespaced=False)
VALIDATING_WEBHOOKS = _resource("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration",
                                "validatingwebhookconfigurations", namespaced=False)
# Capacity asked of the cluster-autoscaler (services/executor/kube/provisioning.py).
PROVISIONING_REQUEST = _resource("autoscaling.x-k8s.io", "v1", "ProvisioningRequest", "provisioningrequests",
                                 namespaced=True)
POD_TEMPLATE = _resource("", "v1", "PodTemplate", "podtemplates", namespaced=True)
_WORKLOADS: dict[str, type] = {}


def workload_resource(kind: WorkloadKind) -> type:
    if kind.kind not in _WORKLOADS:
        _WORKLOADS[kind.kind] = _resource(kind.group, kind.version, kind.kind, kind.plural, namespaced=True)
    return _WORKLOADS[kind.kind]


_STATUSES: dict[type, type] = {}


def status_resource(res: type) -> type:
    """The status subresource of a namespaced resource class (where a kind's controller writes its state)."""
    if res not in _STATUSES:
        info = res._api_info  # type: ignore[attr-defined]  # (set on every class `_resource` builds)
        _STATUSES[res] = type(f"{res.__name__}Status", (GenericNamespacedStatus,), {"_api_info": ApiInfo(
            resource=info.resource, parent=info.resource, plural=info.plural, verbs=["get", "patch", "put"],
            action="status")})
    return _STATUSES[res]


def plain(obj: Any) -> dict[str, Any]:
    """A lightkube generic object as a plain JSON dict."""
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out


def status_code(exc: BaseException) -> int | None:
    """The HTTP status of a failed call: lightkube's ApiError carries the API's Status; a watch refused before it
    streams (410 Gone on resume) is a plain HTTP status error."""
    if isinstance(exc, ApiError) and exc.status.code:
        return int(exc.status.code)
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    return int(code) if code is not None else None


def load_config(kubeconfig: str | Path | None) -> KubeConfig:
    """A kubeconfig file, or the pod's service account (in-cluster) when no path is given."""
    if kubeconfig is None:
        return KubeConfig.from_service_account()
    return KubeConfig.from_file(kubeconfig)


class KubeApi:
    """The calls the executor makes, and nothing else (docs/kubernetes.md lists the RBAC they need)."""

    def __init__(self, config: KubeConfig, *, namespace: str | None = None):
        self.config = config
        self.client: Any = self._open()
        self.namespace = namespace  # None = all namespaces

    def _open(self) -> Any:
        # Resource classes are built at run time (generic dicts), which lightkube's overloads cannot type: Any.
        return AsyncClient(config=self.config, field_manager=FIELD_MANAGER)  # lightkube's 10 s timeout

    async def close(self) -> None:
        """Close the client's connections. The API stays usable: the next call opens new ones (an executor that
        lost its lease stops watching, and watches again when it leads again)."""
        client, self.client = self.client, self._open()
        with contextlib.suppress(Exception):
            await client.close()

    def _ns(self, res: type, everywhere: bool = False) -> dict[str, Any]:
        """The namespace to list in: the executor's own (None: all), or all with `everywhere` (what others hold
        on the nodes is in any namespace)."""
        if issubclass(res, GenericNamespacedResource):
            return {"namespace": ALL_NS if everywhere else self.namespace or ALL_NS}
        return {}

    async def list(self, res: type, labels: Mapping[str, Any] | None = None, fields: Mapping[str, Any] | None = None,
                   everywhere: bool = False) -> tuple[list[dict[str, Any]], str]:
        """Every object and the list's resourceVersion (where a watch starts)."""
        it = self.client.list(res, labels=labels, fields=fields, **self._ns(res, everywhere))
        items = [plain(o) async for o in it]
        return items, str(it.resourceVersion)

    async def watch(self, res: type, resource_version: str, labels: Mapping[str, Any] | None = None,
                    server_timeout_s: int = 240, fields: Mapping[str, Any] | None = None, everywhere: bool = False
                    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Changes after `resource_version`. Raises ApiError(410) when that version is too old (relist)."""
        stream = self.client.watch(res, labels=labels, fields=fields, resource_version=resource_version,
                                   server_timeout=server_timeout_s, **self._ns(res, everywhere))
        async for kind, obj in stream:
            yield kind, plain(obj)

    async def get(self, res: type, name: str, namespace: str | None = None) -> dict[str, Any]:
        kw = {"namespace": namespace} if namespace else {}
        return plain(await self.client.get(res, name, **kw))

    async def patch(self, res: type, name: str, patch: Mapping[str, Any], namespace: str | None = None
                    ) -> dict[str, Any]:
        kw = {"namespace": namespace} if namespace else {}
        return plain(await self.client.patch(res, name, dict(patch), patch_type=PatchType.MERGE, **kw))

    async def patch_status(self, res: type, name: str, patch: Mapping[str, Any], namespace: str) -> dict[str, Any]:
        """A JSON merge patch of the object's status subresource."""
        return plain(await self.client.patch(status_resource(res), name, dict(patch), patch_type=PatchType.MERGE,
                                             namespace=namespace))

    async def create(self, res: type, obj: Mapping[str, Any], namespace: str) -> dict[str, Any]:
        return plain(await self.client.create(res(obj), namespace=namespace))

    async def delete(self, res: type, name: str, namespace: str) -> None:
        await self.client.delete(res, name, namespace=namespace)
