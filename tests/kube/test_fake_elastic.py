"""An elastic PyTorchJob grown and shrunk on the fake API server with the fake training operator (issue 48 item 2):
the patches gpuq writes (services/core/kube/elastic.py) change its Worker replicas, the operator creates or deletes
worker pods, and the workload and its pods carry the target size the SDK reads."""

from __future__ import annotations

from typing import Any

from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from services.core.kube import names as n
from services.core.kube.elastic import pod_notice, resize_patch
from services.core.kube.kinds import kind_of
from shared.domain import JobSpec, PodSet
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.kinds import PyTorchJob
from tests.kube.kubefake.resources import PODS, PYTORCHJOBS

NS = "default"
PT = kind_of("kubeflow.org/v1", "PyTorchJob")
SELECTOR = "training.kubeflow.org/job-name=el"
SPEC = JobSpec(job_id="el", team="t", queue="t",
               pod_sets=(PodSet(name="worker", count=4, min_count=1, gpus_per_pod=1, cpu_milli=0, memory_mib=0),))


def elastic_job() -> Any:
    template = {"spec": {"containers": [{"name": "pytorch", "image": "trainer:1",
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    return PyTorchJob.from_dict({"metadata": {"name": "el", "namespace": NS}, "spec": {
        "runPolicy": {"suspend": False},
        "elasticPolicy": {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d"},
        "pytorchReplicaSpecs": {"Worker": {"replicas": 2, "restartPolicy": "Never", "template": template}}}})


def workers(kube_api: KubeCluster) -> list[str]:
    return sorted(p["metadata"]["name"] for p in kube_api.fake.store.list(PODS, NS)
                  if not p["metadata"].get("deletionTimestamp"))


async def resize(kube_api: KubeCluster, pods: int) -> None:
    """What the executor writes for a resize: the workload's patch, then each pod's notice."""
    assert PT is not None
    client = kube_api.client()
    obj = kube_api.fake.store.get(PYTORCHJOBS, NS, "el")
    await client.patch(PyTorchJob, "el", resize_patch(PT, obj, SPEC, {"worker": pods}), namespace=NS,
                       patch_type=PatchType.MERGE)
    await kube_api.fake.settle()
    for name in workers(kube_api):
        await client.patch(Pod, name, pod_notice(SPEC, {"worker": pods}), namespace=NS,
                           patch_type=PatchType.MERGE)


async def test_an_elastic_pytorchjob_grows_and_shrinks_with_its_pods_told(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    await kube_api.client().create(elastic_job())
    await kube_api.run_pods_to_ready(NS, SELECTOR, count=2)
    assert workers(kube_api) == ["el-worker-0", "el-worker-1"]

    await resize(kube_api, 4)
    await kube_api.run_pods_to_ready(NS, SELECTOR, count=4)
    assert workers(kube_api) == [f"el-worker-{i}" for i in range(4)]
    job = fake.store.get(PYTORCHJOBS, NS, "el")
    assert job["metadata"]["annotations"][n.TARGET_PODS_ANNOTATION] == "4"
    for pod in fake.store.list(PODS, NS):
        assert pod["metadata"]["annotations"][n.TARGET_PODS_ANNOTATION] == "4"

    await resize(kube_api, 1)  # shrunk to its floor: the highest-numbered workers go
    assert workers(kube_api) == ["el-worker-0"]
    [pod] = [p for p in fake.store.list(PODS, NS) if not p["metadata"].get("deletionTimestamp")]
    assert pod["metadata"]["annotations"][n.TARGET_PODS_BY_SET_ANNOTATION] == "worker=1"
    assert fake.store.get(PYTORCHJOBS, NS, "el")["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
