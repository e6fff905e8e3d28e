"""Dynamic Resource Allocation (resource.k8s.io/v1, Kubernetes 1.34+) for NVIDIA's DRA driver (`gpu.nvidia.com`).

Where the API server serves resource.k8s.io, the executor reads the ResourceSlices the driver publishes: each
node's GPU devices (attribute `type` = gpu, `productName`, capacity `memory`). A node whose GPUs are DRA devices
(it advertises no `nvidia.com/gpu`) is announced with them as its GPUs (`with_devices`): the scheduler places
against them as it does against any node's GPUs, whole GPU index i being the node's i-th device (`node_devices`
orders them by their `index` attribute, then name).

Placing an event-submitted job's whole-GPU pod set on such nodes makes a ResourceClaimTemplate asking
`gpus_per_pod` devices of the `gpu.nvidia.com` DeviceClass (`claim_template`), which its pod template names
(`with_claim`, instead of `nvidia.com/gpu`). The resourceclaim controller makes each pod its own ResourceClaim from
it; while the pod is still held by gpuq's scheduling gate, gpuq writes the devices of the pod's binding into that
claim as its allocation result (`allocation`: status.allocation.devices.results, with a nodeSelector on the node),
and only then removes the gate. kube-scheduler finds the claim allocated and binds the pod where the devices are;
the gang rule and the gate are the same as for device-plugin GPUs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.core.kube import names as n
from services.core.kube.quantity import mebibytes
from shared.config import KubernetesSource
from shared.domain import GpuBinding, NodeSpec

DRIVER = "gpu.nvidia.com"  # NVIDIA's DRA driver, and the DeviceClass its chart installs for whole GPUs
DEVICE_CLASS = "gpu.nvidia.com"
GROUP = "resource.k8s.io"
VERSION = "v1"
CLAIM_NAME = "gpus"  # the pod's claim, and the request in it
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"


@dataclass(frozen=True)
class Device:
    """One GPU a node's ResourceSlices publish."""

    name: str
    pool: str
    driver: str
    product: str
    memory_mib: int
    index: int


def _attr(device: Mapping[str, Any], key: str) -> Any:
    value = (device.get("attributes") or {}).get(key) or {}
    for kind in ("string", "int", "bool", "version"):
        if kind in value:
            return value[kind]
    return None


def node_devices(slices: Iterable[Mapping[str, Any]], driver: str = DRIVER) -> dict[str, tuple[Device, ...]]:
    """Each node's whole GPUs from ResourceSlices (of `driver`, devices of type gpu; MIG devices are not whole
    GPUs), ordered by their index attribute then name; a slice that names no node (network-attached devices) is not
    a node's. A device with a malformed memory capacity counts with 0 MiB."""
    out: dict[str, list[Device]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        node = spec.get("nodeName")
        if not node or spec.get("driver") != driver:
            continue
        pool = (spec.get("pool") or {}).get("name") or node
        for d in spec.get("devices") or []:
            kind = _attr(d, "type")
            if kind is not None and kind != "gpu":
                continue
            try:
                memory = mebibytes(((d.get("capacity") or {}).get("memory") or {}).get("value") or 0)
            except ValueError:
                memory = 0
            index = _attr(d, "index")
            out.setdefault(node, []).append(Device(name=d["name"], pool=pool, driver=driver,
                                                   product=str(_attr(d, "productName") or ""), memory_mib=memory,
                                                   index=index if isinstance(index, int) else 1 << 20))
    return {node: tuple(sorted(devs, key=lambda d: (d.index, d.name))) for node, devs in sorted(out.items())}


def with_devices(spec: NodeSpec, devices: tuple[Device, ...], cfg: KubernetesSource) -> NodeSpec:
    """The node announced with its DRA GPUs, when it advertises no GPUs through the device plugin (a node that does
    is left as it is: its devices are the device plugin's). The model is the flavor of the devices' productName
    (written as GFD writes the product label, spaces as dashes, looked up in gpu_flavors). The NodeSpec carries
    the label `gpuq.io/dra-driver` (gpuq's own: workloads created in the cluster keep their GPU pods off it)."""
    if not devices or spec.gpus or spec.mig is not None or spec.mig_profiles or spec.sharing is not None:
        return spec
    product = devices[0].product.replace(" ", "-")
    model = cfg.gpu_flavors.get(product, cfg.gpu_flavors.get(devices[0].product, product)) if product \
        else spec.gpu_model
    return spec.model_copy(update={"gpus": len(devices), "gpu_model": model,
                                   "labels": {**spec.labels, n.DRA_NODE_LABEL: devices[0].driver}})


def claim_template_name(workload: str, pod_set: str) -> str:
    return f"{workload}-{pod_set.replace('_', '-').replace('.', '-')}-gpus"[:253]


def claim_template(name: str, namespace: str, gpus: int, owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ResourceClaimTemplate of a pod set: `gpus` devices of the gpu.nvidia.com class per pod, owned by the
    workload (gone with it)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "gpuq"}}
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceClaimTemplate", "metadata": meta, "spec": {"spec": {
        "devices": {"requests": [{"name": CLAIM_NAME, "exactly": {
            "deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": gpus}}]}}}}


def with_claim(template: Mapping[str, Any], claim_template: str) -> dict[str, Any]:
    """A pod template whose GPUs come from its own claim made from `claim_template` instead of `nvidia.com/gpu`."""
    out = copy.deepcopy(dict(template))
    spec = out.setdefault("spec", {})
    claims = [c for c in spec.get("resourceClaims") or [] if c.get("name") != CLAIM_NAME]
    spec["resourceClaims"] = [*claims, {"name": CLAIM_NAME, "resourceClaimTemplateName": claim_template}]
    for c in spec.get("containers") or []:
        resources = c.setdefault("resources", {})
        for part in ("limits", "requests"):
            if n.GPU_RESOURCE in (resources.get(part) or {}):
                del resources[part][n.GPU_RESOURCE]
        if c is spec["containers"][0]:
            resources["claims"] = [*[x for x in resources.get("claims") or [] if x.get("name") != CLAIM_NAME],
                                   {"name": CLAIM_NAME}]
    return out


def pod_claim(pod: Mapping[str, Any]) -> str | None:
    """The name of the ResourceClaim made for the pod's `gpus` claim (its status says, once the controller made it)."""
    for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if s.get("name") == CLAIM_NAME:
            return s.get("resourceClaimName") or None
    return None


def asks_claim(pod: Mapping[str, Any]) -> bool:
    return any(c.get("name") == CLAIM_NAME and c.get("resourceClaimTemplateName")
               for c in (pod.get("spec") or {}).get("resourceClaims") or [])


def allocation(binding: GpuBinding, devices: tuple[Device, ...]) -> dict[str, Any]:
    """The status of a pod's claim once gpuq allocated its binding's devices (whole GPU index i: the node's i-th
    device): one result per device, and a nodeSelector on the node. Raises ValueError when the node no longer
    publishes that many devices."""
    missing = [i for i in binding.gpu_indices if i >= len(devices)]
    if missing:
        raise ValueError(f"node {binding.node} publishes {len(devices)} GPU device(s), the placement uses index "
                         f"{missing[0]}")
    results = [{"request": CLAIM_NAME, "driver": devices[i].driver, "pool": devices[i].pool,
                "device": devices[i].name} for i in binding.gpu_indices]
    return {"status": {"allocation": {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [binding.node]}]}]}}}}


def allocated(claim: Mapping[str, Any]) -> bool:
    return bool(((claim.get("status") or {}).get("allocation") or {}).get("devices"))
