"""A Kubeflow Notebook (kubeflow.org/v1) through the Kubernetes executor (issue 48): created stopped
(`kubeflow-resource-stopped`) and labelled for a queue, it is taken in as a job of class `notebook`, admitted
borrowing team-b's quota, started by removing the annotation with gpuq's placement written into its template and its
labels (which the fake notebook controller copies to the pod `<notebook>-0`, created gated and ungated by gpuq on the
node it chose). When team-b's job reclaims the quota, the notebook's pod is asked to checkpoint, answers through the
SDK, and the Notebook is stopped, given back as written (no gate, no gpuq labels) and requeued; it starts again
resuming from its checkpoint. Real NATS and Postgres, the fake API server through lightkube. (Fails on the code
before: no Notebook kind is registered, so nothing is taken in.)"""

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
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]},
                   {"name": "ml-team-b", "team": "team-b", "queues": ["team-b"]}],
    "policy": {"protection_window_s": 0, "checkpoint_grace_s": 300},
})
NOTEBOOK = create_namespaced_resource("kubeflow.org", "v1", "Notebook", "notebooks")
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
STOPPED = "kubeflow-resource-stopped"
RESUME_ENV = {"name": "GPUQ_RESUME_FROM",
              "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['gpuq.io/resume-from']"}}}
CONTAINER = {"name": "lab", "image": "ghcr.io/example/jupyter:1", "env": [RESUME_ENV],
             "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "4", "memory": "16Gi"}}}


def notebook() -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": "Notebook",
            "metadata": {"name": "lab", "namespace": "ml-team-a",
                         "labels": {"gpuq.io/queue": "team-a", "gpuq.io/priority-class": "low"},
                         "annotations": {STOPPED: "2026-12-06T07:00:00Z", "gpuq.io/checkpoint": "true"}},
            "spec": {"template": {"spec": {"containers": [CONTAINER], "terminationGracePeriodSeconds": 30}}}}


def owner_job() -> dict[str, Any]:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "8", "memory": "32Gi"}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": "ml-team-b",
                         "labels": {"gpuq.io/queue": "team-b", "gpuq.io/priority-class": "high"}},
            "spec": {"suspend": True, "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                     "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}


async def test_a_notebook_is_held_started_checkpointed_stopped_and_resumed(fresh: tuple[str, str],
                                                                         kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n1", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in ("ml-team-a", "ml-team-b"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "preemption", "executor")):
        await client.create(NOTEBOOK(notebook()))
        (submitted,) = await eventually("JobSubmitted", lambda: bus_events(nats_url, "job.submitted.team-a"))
        assert submitted["spec"]["kind"] == "notebook" and submitted["spec"]["pod_sets"][0]["name"] == "notebook"
        started = await eventually("the notebook started", lambda: _running(client))
        assert started["metadata"]["labels"]["gpuq.io/pod-set"] == "notebook"
        assert started["spec"]["template"]["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
        (pod,) = await eventually("its pod ungated", lambda: _ungated(kube_api))
        assert pod["metadata"]["name"] == "lab-0" and pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "n1"
        await kube_api.run_pods_to_ready("ml-team-a", "gpuq.io/job", count=1)
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))

        await client.create(JOB(owner_job()))
        (asked,) = await eventually("the checkpoint request on the notebook's pod",
                                    lambda: _annotated(kube_api, "gpuq.io/checkpoint-requested"))
        uri = "s3://checkpoints/lab/step-7"
        await asyncio.to_thread(gpuq_sdk.report_checkpoint, uri, step=7, pod=asked["metadata"]["name"],
                                namespace="ml-team-a", api_url=kube_api.server, token=kube_api.token)
        (preempted,) = await eventually("JobPreempted", lambda: bus_events(nats_url, "job.preempted"))
        assert preempted["checkpoint_uri"] == uri
        await eventually("the notebook stopped and given back as written", lambda: _restored(client))
        (requeued,) = await eventually("JobRequeued", lambda: bus_events(nats_url, "job.requeued"))
        assert requeued["resume_from"] == uri
        fake.advance(60)  # the stopped notebook's pod finishes its grace period

        await eventually("the owner's pod ungated", lambda: _ungated(kube_api, "ml-team-b"))
        await kube_api.run_pods_to_ready("ml-team-b", "gpuq.io/job", count=1)
        await kube_api.complete_pods("ml-team-b", "gpuq.io/job")

        (resumed,) = await eventually("the notebook's pod again", lambda: _ungated(kube_api))
        assert resumed["metadata"]["annotations"]["gpuq.io/resume-from"] == uri
        assert RESUME_ENV in resumed["spec"]["containers"][0]["env"]
        reasons = [e["reason"] for e in await workload_events(client, "ml-team-a", "lab")]
        assert {"Submitted", "Admitted", "CheckpointRequested", "Preempted", "Requeued"} <= set(reasons)


async def _running(client: Any) -> dict[str, Any] | None:
    obj = (await client.get(NOTEBOOK, "lab", namespace="ml-team-a")).to_dict()
    return None if STOPPED in (obj["metadata"].get("annotations") or {}) else obj


async def _ungated(kube_api: Any, namespace: str = "ml-team-a") -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(namespace, "gpuq.io/job")
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running")]
    if len(pods) == 1 and not pods[0]["spec"].get("schedulingGates"):
        return pods
    return None


async def _annotated(kube_api: Any, key: str) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods("ml-team-a", "gpuq.io/job")
            if key in p["metadata"].get("annotations", {})]
    return pods or None


async def _restored(client: Any) -> bool:
    obj = (await client.get(NOTEBOOK, "lab", namespace="ml-team-a")).to_dict()
    meta = obj["metadata"]
    template = obj["spec"]["template"]["spec"]
    return (STOPPED in (meta.get("annotations") or {}) and not template.get("schedulingGates")
            and "affinity" not in template and "gpuq.io/job" not in (meta.get("labels") or {})
            and "gpuq.io/resume-from" not in (meta.get("annotations") or {}))
