"""DRA on the fake API server (resource.k8s.io/v1): the resourceclaim controller stand-in makes a pod's claim from
its template; the fake kube-scheduler binds the pod only once the claim is allocated, where the allocation says,
and reserves the claim for it. The executor's allocation step writes the binding's devices into a pod's claim, or
leaves the claim to kube-scheduler when the node does not publish them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from services.core.kube.dra import node_devices
from services.executor.kube.client import KubeApi, load_config
from services.executor.kube.devices import RESOURCE_SLICE
from services.executor.kube.pods import PodWatch
from shared.domain import GpuBinding
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import PODS, RESOURCE_CLAIMS

NS = "default"
TEMPLATE = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaimTemplate", "resourceclaimtemplates")


async def _pod_with_claim(kube_api: KubeCluster, name: str) -> dict[str, Any]:
    client = kube_api.client()
    await client.create(Pod.from_dict({"metadata": {"name": name, "namespace": NS}, "spec": {
        "restartPolicy": "Never", "schedulingGates": [{"name": "gpuq.io/placement"}],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two-gpus"}],
        "containers": [{"name": "c", "image": "x", "resources": {"claims": [{"name": "gpus"}]}}]}}))
    kube_api.fake.settle_now()
    pod: dict[str, Any] = kube_api.fake.store.get(PODS, NS, name)
    return pod


async def test_claims_are_made_from_templates_and_pods_bind_where_their_allocation_says(
        kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("a", "b"):
        fake.add_node(node)
        fake.add_gpu_slice(node, gpus=2)
    await kube_api.client().create(TEMPLATE({"metadata": {"name": "two-gpus", "namespace": NS}, "spec": {"spec": {
        "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                               "allocationMode": "ExactCount", "count": 2}}]}}}}))
    pod = await _pod_with_claim(kube_api, "p")
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = fake.store.get(RESOURCE_CLAIMS, NS, status["resourceClaimName"])
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] == "gpus"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert claim["spec"]["devices"]["requests"][0]["exactly"]["count"] == 2

    api = KubeApi(load_config(kube_api.kubeconfig))
    try:
        slices, _ = await api.list(RESOURCE_SLICE)
        devices = node_devices(slices)
        watch = SimpleNamespace(api=api, nodes=SimpleNamespace(devices=devices))
        # ungated with the claim unallocated: the fake allocates nothing, so the pod stays unschedulable
        fake.store.mutate(PODS, NS, "p", lambda p: p["spec"].update(schedulingGates=[]))
        fake.settle_now()
        waiting = fake.store.get(PODS, NS, "p")
        assert not waiting["spec"].get("nodeName")
        assert "is not allocated" in next(c["message"] for c in waiting["status"]["conditions"]
                                          if c["type"] == "PodScheduled")
        # the executor's step: the binding's devices (on b) as the claim's allocation; the pod binds to b
        assert await PodWatch._allocate(watch, {"namespace": NS}, pod,  # type: ignore[arg-type]
                                        GpuBinding(pod="main-0", node="b", gpu_indices=(0, 1)))
        fake.settle_now()
        bound = fake.store.get(PODS, NS, "p")
        claim = fake.store.get(RESOURCE_CLAIMS, NS, status["resourceClaimName"])
        assert bound["spec"]["nodeName"] == "b"
        assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0", "gpu-1"]
        assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "p", "uid": pod["metadata"]["uid"]}]
        # a node that publishes no such devices: the claim is left to kube-scheduler, not allocated by gpuq
        other = await _pod_with_claim(kube_api, "q")
        (other_status,) = other["status"]["resourceClaimStatuses"]
        assert await PodWatch._allocate(watch, {"namespace": NS}, other,  # type: ignore[arg-type]
                                        GpuBinding(pod="main-1", node="a", gpu_indices=(2, 3)))
        assert "allocation" not in (fake.store.get(RESOURCE_CLAIMS, NS, other_status["resourceClaimName"])
                                    .get("status") or {})
    finally:
        await api.close()
