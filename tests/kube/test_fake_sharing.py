"""Nodes sharing GPUs on the fake API server, read through the executor's own client (issue 47): time-sliced and
MPS nodes advertise replicas that are not whole GPUs, a renamed nvidia.com/gpu.shared, and a mixed-MIG node its
profiles beside its whole GPUs; the fake kube-scheduler fits pods asking those resources."""

from __future__ import annotations

from lightkube.resources.core_v1 import Pod

from services.executor.kube import inventory
from services.executor.kube.client import NODE, KubeApi, load_config
from shared.domain import SharingMode
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube_support import H100, kube_cluster


async def test_sharing_and_mixed_mig_nodes_are_read_from_what_gfd_and_the_device_plugin_advertise(
        kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("ts", gpus=2, gpu_product=H100, gpu_memory_mib=81559, sharing="time-slicing", replicas=4)
    fake.add_node("mps", gpus=1, gpu_product=H100, gpu_memory_mib=81559, sharing="mps", replicas=10, renamed=True)
    fake.add_node("mixed", gpus=2, gpu_product=H100, mig={"1g.10gb": 7, "3g.40gb": 2})
    fake.add_node("whole", gpus=8, gpu_product=H100)
    api = KubeApi(load_config(kube_api.kubeconfig))
    try:
        objects, _ = await api.list(NODE)
        nodes = inventory.specs(objects, kube_cluster().kubernetes)
    finally:
        await api.close()
    ts, mps, mixed, whole = nodes["ts"], nodes["mps"], nodes["mixed"], nodes["whole"]
    # 8 replicas of 2 GPUs are 2 shared GPUs of the H100 flavor (the product's -SHARED suffix dropped), not 8 whole
    assert (ts.gpus, ts.gpu_model, ts.shared_gpus) == (2, "H100-80GB", 2)
    assert ts.sharing is not None and (ts.sharing.mode, ts.sharing.replicas, ts.sharing.resource,
                                       ts.sharing.gpu_memory_mib) == (SharingMode.TIME_SLICING, 4, "nvidia.com/gpu",
                                                                      81559)
    assert mps.sharing is not None and (mps.gpus, mps.sharing.mode, mps.sharing.resource) == (
        1, SharingMode.MPS, "nvidia.com/gpu.shared")
    assert (mixed.gpus, mixed.mig, mixed.mig_profiles) == (2, None, {"1g.10gb": 7, "3g.40gb": 2})
    assert (whole.gpus, whole.sharing, whole.mig_profiles) == (8, None, {})


async def test_the_fake_scheduler_fits_replicas_and_profiles_as_advertised(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("mps", gpus=1, gpu_product=H100, sharing="mps", replicas=2, renamed=True)
    client = kube_api.client()

    def pod(name: str, resource: str) -> Pod:
        return Pod.from_dict({"metadata": {"name": name, "namespace": "default"}, "spec": {
            "restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "resources": {
                "limits": {resource: "1"}}}]}})

    for name in ("a", "b", "c"):
        await client.create(pod(name, "nvidia.com/gpu.shared"))
    await client.create(pod("whole", "nvidia.com/gpu"))
    fake.settle_now()
    bound = {p.metadata.name: p.spec.nodeName async for p in client.list(Pod, namespace="default")}
    assert bound == {"a": "mps", "b": "mps", "c": None, "whole": None}  # 2 replicas; no whole GPU advertised
