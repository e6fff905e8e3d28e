"""Done means, reclaim on Kubernetes: a low-priority Job of team-a borrows team-b's quota; team-b's higher-priority
job arrives; gpuq annotates the borrower's pods with the checkpoint request; the job answers through the SDK helper
(which patches its own pod); the workload is suspended and requeued, and when it runs again its pods resume from
the checkpoint (GPUQ_RESUME_FROM). Real NATS, real Postgres, the fake API server through lightkube."""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube.generic_resource import create_namespaced_resource

import gpuq_sdk
from shared.config import parse_queues
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack, workload_events

QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]},
                   {"name": "ml-team-b", "team": "team-b", "queues": ["team-b"]}],
    "policy": {"protection_window_s": 0, "checkpoint_grace_s": 300},
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
RESUME_ENV = {"name": "GPUQ_RESUME_FROM",
              "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['gpuq.io/resume-from']"}}}


def job(name: str, namespace: str, queue: str, priority: str, pods: int, checkpoint: bool) -> dict[str, Any]:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1", "env": [RESUME_ENV],
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "8", "memory": "32Gi"}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"gpuq.io/queue": queue, "gpuq.io/priority-class": priority},
                         "annotations": {"gpuq.io/checkpoint": "true"} if checkpoint else {}},
            "spec": {"suspend": True, "completionMode": "Indexed", "completions": pods, "parallelism": pods,
                     "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                                                             "terminationGracePeriodSeconds": 30}}}}


async def test_borrower_checkpoints_through_the_sdk_is_requeued_and_resumes(fresh: tuple[str, str],
                                                                            kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for name in ("n1", "n2"):
        fake.add_node(name, gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in ("ml-team-a", "ml-team-b"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "preemption", "executor")):
        await client.create(JOB(job("sweep", "ml-team-a", "team-a", "low", pods=2, checkpoint=True)))
        await eventually("the borrower's pods ungated", lambda: _ungated(kube_api, "ml-team-a", 2))
        await kube_api.run_pods_to_ready("ml-team-a", "gpuq.io/job", count=2)
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))

        await client.create(JOB(job("train", "ml-team-b", "team-b", "high", pods=1, checkpoint=False)))
        asked = await eventually("the checkpoint request on the borrower's pods",
                                 lambda: _annotated(kube_api, "ml-team-a", "gpuq.io/checkpoint-requested"))
        uri = "s3://checkpoints/sweep/step-1200"
        # The training code's answer: the SDK patches its own pod through the API (here with the fake's address
        # and token instead of the in-cluster service account). It is synchronous, as training code is: run it in a
        # thread, since the fake API server shares this event loop.
        await asyncio.to_thread(gpuq_sdk.report_checkpoint, uri, step=1200, pod=asked[0]["metadata"]["name"],
                                namespace="ml-team-a", api_url=kube_api.server, token=kube_api.token)

        preempted = await eventually("JobPreempted", lambda: bus_events(nats_url, "job.preempted"))
        assert preempted[0]["reason"] == "ReclaimQuota" and preempted[0]["checkpoint_uri"] == uri
        suspended = await eventually("the borrower suspended", lambda: _suspended(client, "ml-team-a", "sweep"))
        assert suspended
        # Once stopped, the Job gets its template back as written (no gate, no node restriction, no resume point).
        await eventually("the template restored", lambda: _restored(client, "ml-team-a", "sweep"))
        requeued = await eventually("JobRequeued", lambda: bus_events(nats_url, "job.requeued"))
        assert requeued[0]["resume_from"] == uri
        fake.advance(60)  # the suspended Job's pods finish their grace period

        await eventually("the owner's pod ungated", lambda: _ungated(kube_api, "ml-team-b", 1))
        await kube_api.run_pods_to_ready("ml-team-b", "gpuq.io/job", count=1)
        await kube_api.complete_pods("ml-team-b", "gpuq.io/job")

        # The borrower runs again, resuming from its checkpoint.
        resumed = await eventually("the borrower's new pods", lambda: _ungated(kube_api, "ml-team-a", 2))
        for pod in resumed:
            assert pod["metadata"]["annotations"]["gpuq.io/resume-from"] == uri
            assert pod["metadata"]["annotations"]["gpuq.io/binding"].startswith("2/")
            assert RESUME_ENV in pod["spec"]["containers"][0]["env"]
        reasons = [e["reason"] for e in await workload_events(client, "ml-team-a", "sweep")]
        assert {"CheckpointRequested", "Preempted", "Requeued"} <= set(reasons)


async def _ungated(kube_api: Any, namespace: str, count: int) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(namespace, "gpuq.io/job")
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running")]
    if len(pods) == count and all(not p["spec"].get("schedulingGates") for p in pods):
        return pods
    return None


async def _annotated(kube_api: Any, namespace: str, key: str) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(namespace, "gpuq.io/job") if key in p["metadata"].get("annotations", {})]
    return pods or None


async def _suspended(client: Any, namespace: str, name: str) -> bool:
    obj = await client.get(JOB, name, namespace=namespace)
    return bool(obj["spec"].get("suspend"))


async def _restored(client: Any, namespace: str, name: str) -> bool:
    template = (await client.get(JOB, name, namespace=namespace))["spec"]["template"]
    return not template["spec"].get("schedulingGates") and "affinity" not in template["spec"] \
        and "gpuq.io/resume-from" not in (template["metadata"].get("annotations") or {})
