"""An elastic PyTorchJob resized by the services on the fake API server (issue 48 item 2; docs/kubernetes.md,
"Elastic workloads"): admission, the scheduler and the Kubernetes executor with the fake training operator. The job
starts at its floor while another job holds the GPUs, grows when they free up (its Worker replicas and the target
annotation written, the operator's new worker pods ungated onto the chosen node), and shrinks when a job of another
queue arrives within its guaranteed quota and does not fit, which is then placed without any preemption."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.batch_v1 import Job

from services.core.kube import names as n
from shared.config import parse_queues
from tests.kube.kubefake.resources import EVENTS, PODS, PYTORCHJOBS
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack

A, B = "ml-team-a", "ml-team-b"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": q, "teams": [q], "quotas": {"H100-80GB": {"nominal": 8}}} for q in ("team-a", "team-b")],
    "namespaces": [{"name": A, "team": "team-a", "queues": ["team-a"]},
                   {"name": B, "team": "team-b", "queues": ["team-b"]}],
})
PYTORCHJOB = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")


def pod_template(gpus: int) -> dict[str, Any]:
    return {"spec": {"restartPolicy": "Never", "containers": [{
        "name": "main", "image": "ghcr.io/example/train:1", "command": ["sleep", "3600"],
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "1", "memory": "1Gi"}}}]}}


def batch_job(name: str, namespace: str, queue: str, gpus: int) -> Job:
    return Job.from_dict({"metadata": {"name": name, "namespace": namespace, "labels": {"gpuq.io/queue": queue}},
                          "spec": {"suspend": True, "backoffLimit": 0, "template": pod_template(gpus)}})


def elastic_job() -> Any:
    return PYTORCHJOB({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                       "metadata": {"name": "el", "namespace": A, "labels": {"gpuq.io/queue": "team-a"}},
                       "spec": {"runPolicy": {"suspend": True},
                                "elasticPolicy": {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d"},
                                "pytorchReplicaSpecs": {"Worker": {"replicas": 4, "restartPolicy": "Never",
                                                                   "template": pod_template(1)}}}})


def live(kube_api: Any, namespace: str, prefix: str) -> list[dict[str, Any]]:
    return sorted((p for p in kube_api.fake.store.list(PODS, namespace)
                   if p["metadata"]["name"].startswith(prefix) and not p["metadata"].get("deletionTimestamp")
                   and p["status"].get("phase") not in ("Succeeded", "Failed")),
                  key=lambda p: p["metadata"]["name"])


def running_workers(kube_api: Any, count: int) -> list[dict[str, Any]] | None:
    """The elastic job's workers when exactly `count` are live, all ungated, running and told the target `count`."""
    pods = live(kube_api, A, "el-worker-")
    if len(pods) != count or any(p["spec"].get("schedulingGates") or p["status"].get("phase") != "Running"
                                 or (p["metadata"].get("annotations") or {}).get(n.TARGET_PODS_ANNOTATION)
                                 != str(count) for p in pods):
        return None
    job = kube_api.fake.store.get(PYTORCHJOBS, A, "el")
    if job["metadata"].get("annotations", {}).get(n.TARGET_PODS_ANNOTATION) != str(count):
        return None
    return pods


async def test_an_elastic_pytorchjob_starts_at_its_floor_grows_into_freed_gpus_and_shrinks_for_a_guaranteed_job(
        fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("n1", gpus=4, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in (A, B):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(batch_job("blocker", A, "team-a", 3))
        await eventually("the blocker running", lambda: _running(kube_api, A, "blocker-", 1))
        await client.create(elastic_job())
        # 1 GPU free: it starts at its floor, its replicas written as 1
        await eventually("el at its floor", lambda: _sync(running_workers(kube_api, 1)))
        job = kube_api.fake.store.get(PYTORCHJOBS, A, "el")
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1

        await kube_api.complete_pods(A, "batch.kubernetes.io/job-name=blocker")
        # the blocker's 3 GPUs free: grown pod by pod to 4, the new workers ungated onto n1
        pods = await eventually("el grown to 4", lambda: _sync(running_workers(kube_api, 4)))
        assert sorted(p["spec"]["nodeName"] for p in pods) == ["n1"] * 4
        assert kube_api.fake.store.get(PYTORCHJOBS, A, "el")["spec"]["pytorchReplicaSpecs"]["Worker"][
            "replicas"] == 4
        grown = [(r["pods_before"], r["pods"]) for r in await bus_events(nats_url, "job.resized")]
        assert grown == [(1, 2), (2, 3), (3, 4)]

        # team-b's job within its guaranteed quota does not fit: el is shrunk to its floor, the job placed, and el
        # grows again into the GPU left (4 = 2 + 2)
        await client.create(batch_job("urgent", B, "team-b", 2))
        await eventually("urgent running", lambda: _running(kube_api, B, "urgent-", 1))
        await eventually("el at 2", lambda: _sync(running_workers(kube_api, 2)))
        (admitted,) = [e for e in await bus_events(nats_url, "job.admitted") if e["spec"]["team"] == "team-b"]
        resized = [(r["pods_before"], r["pods"], r["reason"], r["for_job"])
                   for r in await bus_events(nats_url, "job.resized")]
        assert resized[3:] == [(4, 1, "Shrink", admitted["job_id"]), (1, 2, "Grow", None)]
        assert await bus_events(nats_url, "preemption.requested") == []
        notes = [e for e in kube_api.fake.store.list(EVENTS, A) if e.get("reason") == "Resized"]
        assert any("to make room for" in e["message"] for e in notes)


async def _running(kube_api: Any, namespace: str, prefix: str, count: int) -> bool:
    pods = live(kube_api, namespace, prefix)
    return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)


async def _sync(value: Any) -> Any:
    return value
