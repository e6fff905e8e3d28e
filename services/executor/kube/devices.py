"""DRA objects the executor reads and writes (resource.k8s.io/v1; core/kube/dra.py says what it does with them)."""

from __future__ import annotations

import logging

from lightkube.generic_resource import GenericGlobalResource, GenericNamespacedResource, create_api_info

from services.core.kube.dra import GROUP, VERSION
from services.executor.kube.client import KubeApi, status_code

log = logging.getLogger("gpuq.executor.kube")


def _resource(kind: str, plural: str, *, namespaced: bool) -> type:
    base = GenericNamespacedResource if namespaced else GenericGlobalResource
    return type(kind, (base,), {"_api_info": create_api_info(GROUP, VERSION, kind, plural)})


RESOURCE_SLICE = _resource("ResourceSlice", "resourceslices", namespaced=False)
RESOURCE_CLAIM = _resource("ResourceClaim", "resourceclaims", namespaced=True)
RESOURCE_CLAIM_TEMPLATE = _resource("ResourceClaimTemplate", "resourceclaimtemplates", namespaced=True)


async def serves_dra(api: KubeApi) -> bool:
    """Whether the API server serves resource.k8s.io/v1 ResourceSlices to this executor (Kubernetes 1.34+, and the
    executor's role may list them): a 404 or 403 means DRA is off, said once."""
    try:
        await api.list(RESOURCE_SLICE)
    except Exception as exc:
        code = status_code(exc)
        if code not in (403, 404):
            raise
        log.info("DRA is off: %s/%s ResourceSlices are %s", GROUP, VERSION,
                 "not served by this cluster" if code == 404 else "not readable by the executor (its role)")
        return False
    return True
