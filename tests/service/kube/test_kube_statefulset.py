"""A GPU StatefulSet (apps/v1) through the Kubernetes executor (issue 48): created held (replicas 0,
`gpuq.io/replicas: 2`), it is taken in as one pod set `main` of 2 pods, admitted borrowing team-b's quota, started
with its template placed and gated and `replicas` back at 2; the fake StatefulSet controller makes `<sts>-0` and
`<sts>-1`, which gpuq ungates on the nodes it chose. When team-b's job reclaims the quota, the pods are asked to
checkpoint, one answers through the SDK, and the set is held again at 0, given back as written and requeued; it runs
again resuming from the checkpoint. Real NATS and Postgres, the fake API server through lightkube. (Fails on the code
before: no StatefulSet kind is registered, so nothing is taken in.)"""

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
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 0}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 32}}},
    ],
    "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]},
                   {"name": "ml-team-b", "team": "team-b", "queues": ["team-b"]}],
    "policy": {"protection_window_s": 0, "checkpoint_grace_s": 300},
})
STS = create_namespaced_resource("apps", "v1", "StatefulSet", "statefulsets")
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
PODS = 2
RESUME_ENV = {"name": "GPUQ_RESUME_FROM",
              "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['gpuq.io/resume-from']"}}}


def pod_template(role: str) -> dict[str, Any]:
    container = {"name": role, "image": "ghcr.io/example/vllm:1", "env": [RESUME_ENV],
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "4", "memory": "16Gi"}}}
    return {"metadata": {"labels": {"role": role}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 30}}


def sts() -> dict[str, Any]:
    template = pod_template("server")
    template["metadata"]["labels"]["app"] = "serve"
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "serve", "namespace": "ml-team-a",
                         "labels": {"gpuq.io/queue": "team-a", "gpuq.io/priority-class": "low"},
                         "annotations": {"gpuq.io/replicas": "2", "gpuq.io/checkpoint": "true"}},
            "spec": {"replicas": 0, "serviceName": "serve", "selector": {"matchLabels": {"app": "serve"}},
                     "template": template}}


def owner_job() -> dict[str, Any]:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "8", "memory": "32Gi"}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": "ml-team-b",
                         "labels": {"gpuq.io/queue": "team-b", "gpuq.io/priority-class": "high"}},
            "spec": {"suspend": True, "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                     "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}


async def test_a_statefulset_is_held_started_checkpointed_held_again_and_resumed(fresh: tuple[str, str],
                                                                                kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for i in range(PODS):
        fake.add_node(f"n{i}", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in ("ml-team-a", "ml-team-b"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "preemption", "executor")):
        await client.create(STS(sts()))
        (submitted,) = await eventually("JobSubmitted", lambda: bus_events(nats_url, "job.submitted.team-a"))
        assert [(p["name"], p["count"]) for p in submitted["spec"]["pod_sets"]] == [("main", 2)]
        started = await eventually("the set started", lambda: _running(client))
        assert started["spec"]["template"]["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
        assert started["spec"]["template"]["metadata"]["labels"]["app"] == "serve"  # the selector still matches
        pods = await eventually("its pods ungated", lambda: _ungated(kube_api, count=PODS))
        assert sorted(p["metadata"]["name"] for p in pods) == ["serve-0", "serve-1"]
        assert len({p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods}) == PODS
        await kube_api.run_pods_to_ready("ml-team-a", "gpuq.io/job", count=PODS)
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))

        await client.create(JOB(owner_job()))
        asked = (await eventually("the checkpoint request on the set's pods",
                                  lambda: _annotated(kube_api, "gpuq.io/checkpoint-requested", PODS)))[0]
        uri = "s3://checkpoints/serve/step-7"
        await asyncio.to_thread(gpuq_sdk.report_checkpoint, uri, step=7, pod=asked["metadata"]["name"],
                                namespace="ml-team-a", api_url=kube_api.server, token=kube_api.token)
        (preempted,) = await eventually("JobPreempted", lambda: bus_events(nats_url, "job.preempted"))
        assert preempted["checkpoint_uri"] == uri
        await eventually("the set held at zero groups and given back as written", lambda: _restored(client))
        (requeued,) = await eventually("JobRequeued", lambda: bus_events(nats_url, "job.requeued"))
        assert requeued["resume_from"] == uri
        fake.advance(60)  # the held set's pods finish their grace period

        await eventually("the owner's pod ungated", lambda: _ungated(kube_api, "ml-team-b"))
        await kube_api.run_pods_to_ready("ml-team-b", "gpuq.io/job", count=1)
        await kube_api.complete_pods("ml-team-b", "gpuq.io/job")

        resumed = await eventually("the set's pods again", lambda: _ungated(kube_api, count=PODS))
        for pod in resumed:
            assert pod["metadata"]["annotations"]["gpuq.io/resume-from"] == uri
            assert RESUME_ENV in pod["spec"]["containers"][0]["env"]
        reasons = [e["reason"] for e in await workload_events(client, "ml-team-a", "serve")]
        assert {"Submitted", "Admitted", "CheckpointRequested", "Preempted", "Requeued"} <= set(reasons)


async def _running(client: Any) -> dict[str, Any] | None:
    obj = (await client.get(STS, "serve", namespace="ml-team-a")).to_dict()
    return obj if obj["spec"].get("replicas") == 2 else None


async def _ungated(kube_api: Any, namespace: str = "ml-team-a", count: int = 1) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(namespace, "gpuq.io/job")
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running")]
    if len(pods) == count and all(not p["spec"].get("schedulingGates") for p in pods):
        return pods
    return None


async def _annotated(kube_api: Any, key: str, count: int) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods("ml-team-a", "gpuq.io/job")
            if key in p["metadata"].get("annotations", {}) and not p["metadata"].get("deletionTimestamp")]
    return pods if len(pods) == count else None


async def _restored(client: Any) -> bool:
    obj = (await client.get(STS, "serve", namespace="ml-team-a")).to_dict()
    template = obj["spec"]["template"]
    return (obj["spec"]["replicas"] == 0 and not template["spec"].get("schedulingGates")
            and "affinity" not in template["spec"] and "gpuq.io/job" not in template["metadata"].get("labels", {}))
