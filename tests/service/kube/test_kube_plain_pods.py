"""Plain pods through the Kubernetes executor (issue 48 item 1, Kueue's plain-pod integration), on the fake API server
through lightkube with real NATS and Postgres:

- a Pod labelled `gpuq.io/queue`, held by gpuq's gate, is taken in as a job of one pod, admitted, labelled, given its
  node and ungated; when it Succeeds the job completes. A pod in another team's namespace naming this queue is refused.
- a group of 2 (`gpuq.io/pod-group`, `gpuq.io/pod-group-total-count: 2`) is taken in only once both pods exist, runs
  as one gang, and deleting one of its pods cancels the job and deletes the other.
- a borrowing plain pod is preempted by the quota owner's job: asked to checkpoint first (its class asks), then
  deleted, and its job ends cancelled saying why (a pod cannot be suspended and nothing recreates it).

(Fails on the code before: nothing takes a plain pod in; the gated pod stays gated and no job is submitted.)"""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

import gpuq_sdk
from shared.config import parse_queues
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, fetchval, kube_cluster, kube_stack

NS_A, NS_B = "ml-team-a", "ml-team-b"
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 0}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}},
    ],
    "namespaces": [{"name": NS_A, "team": "team-a", "queues": ["team-a"]},
                   {"name": NS_B, "team": "team-b", "queues": ["team-b"]}],
    "policy": {"protection_window_s": 0, "checkpoint_grace_s": 300},
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
STARTED = "gpuq.io/job"  # the label gpuq writes on a plain pod when it starts it


def plain_pod(name: str, namespace: str = NS_A, queue: str = "team-a", *, gpus: int = 8,
              group: tuple[str, int] | None = None, annotations: dict[str, str] | None = None) -> Pod:
    labels = {"gpuq.io/queue": queue, "gpuq.io/priority-class": "low", "app": name}
    notes = dict(annotations or {})
    if group is not None:
        labels["gpuq.io/pod-group"] = group[0]
        notes["gpuq.io/pod-group-total-count"] = str(group[1])
    container = {"name": "main", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "4", "memory": "16Gi"}}}
    return Pod.from_dict({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": notes},
        # held as gpuq's admission webhook holds it (these tests run without the webhook)
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0, "containers": [container],
                 "schedulingGates": [{"name": "gpuq.io/placement"}]}})


def owner_job() -> dict[str, Any]:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "8", "memory": "32Gi"}}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "train", "namespace": NS_B,
                         "labels": {"gpuq.io/queue": "team-b", "gpuq.io/priority-class": "high"}},
            "spec": {"suspend": True, "completionMode": "Indexed", "completions": 2, "parallelism": 2,
                     "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}}}


async def setup(kube_api: Any, nodes: int = 2) -> None:
    for i in range(nodes):
        kube_api.fake.add_node(f"n{i}", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in (NS_A, NS_B):
        await kube_api.create_namespace(ns)


async def submitted(nats_url: str, team: str, count: int) -> list[dict[str, Any]] | None:
    found = await bus_events(nats_url, f"job.submitted.{team}")
    return found if len(found) >= count else None


async def started_pods(kube_api: Any, count: int, namespace: str = NS_A) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(namespace, STARTED)
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("phase") in ("Pending", "Running")]
    if len(pods) == count and all(not p["spec"].get("schedulingGates") for p in pods):
        return pods
    return None


async def test_a_plain_pod_is_held_admitted_placed_and_completed(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    await setup(kube_api)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "executor")):
        # team-b's namespace may not use team-a's queue: refused, never submitted
        await client.create(plain_pod("intruder", NS_B, "team-a"), namespace=NS_B)
        await client.create(plain_pod("solo"), namespace=NS_A)
        (job,) = await eventually("the pod's JobSubmitted", lambda: submitted(nats_url, "team-a", 1))
        assert job["spec"]["job_id"].startswith(f"{NS_A}.solo.")
        assert [(p["name"], p["count"], p["gpus_per_pod"]) for p in job["spec"]["pod_sets"]] == [("main", 1, 8)]
        assert job["spec"]["workload"]["kind"] == "Pod"
        (pod,) = await eventually("the pod labelled, placed and ungated", lambda: started_pods(kube_api, 1))
        assert pod["metadata"]["name"] == "solo"
        assert pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] in ("n0", "n1")
        assert pod["metadata"]["annotations"]["gpuq.io/job-id"] == job["spec"]["job_id"]
        await kube_api.run_pods_to_ready(NS_A, STARTED, count=1)
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        await kube_api.complete_pods(NS_A, STARTED)
        (done,) = await eventually("JobCompleted", lambda: bus_events(nats_url, "job.completed"))
        assert done["job_id"] == job["spec"]["job_id"]
        assert await fetchval(database_url, "SELECT state FROM executor.kube_jobs WHERE job_id = $1",
                              job["spec"]["job_id"]) == "completed"
        assert await fetchval(database_url, "SELECT array_agg(reason) FROM executor.kube_refused") == [
            "QueueNotAllowed"]
        assert not await bus_events(nats_url, "job.submitted.team-b")
        intruder = (await client.get(Pod, "intruder", namespace=NS_B)).to_dict()
        assert intruder["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]  # never started


async def test_a_pod_group_is_admitted_only_once_all_its_pods_exist(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    await setup(kube_api)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "executor")):
        await client.create(plain_pod("gang-0", group=("gang", 2)), namespace=NS_A)
        # a later pod is taken in after the informer has seen the first one: the group alone was not
        await client.create(plain_pod("marker", gpus=0), namespace=NS_A)
        (only,) = await eventually("the marker's JobSubmitted", lambda: submitted(nats_url, "team-a", 1))
        assert only["spec"]["job_id"].startswith(f"{NS_A}.marker.")
        # (a pod asking for no GPU, in a queue with no CPU quota, is then rejected by admission: it stays held)
        await eventually("the marker rejected", lambda: fetchval(
            database_url, "SELECT state = 'rejected' FROM executor.kube_jobs WHERE job_id = $1",
            only["spec"]["job_id"]))
        marker = (await client.get(Pod, "marker", namespace=NS_A)).to_dict()
        assert marker["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
        assert marker["metadata"]["annotations"]["gpuq.io/status"].startswith("Rejected")
        first = (await client.get(Pod, "gang-0", namespace=NS_A)).to_dict()
        assert first["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
        await client.create(plain_pod("gang-1", group=("gang", 2)), namespace=NS_A)
        jobs = await eventually("the group's JobSubmitted", lambda: submitted(nats_url, "team-a", 2))
        (group,) = [j for j in jobs if j["spec"]["job_id"].startswith(f"{NS_A}.gang.")]
        assert [(p["name"], p["count"], p["gpus_per_pod"]) for p in group["spec"]["pod_sets"]] == [("main", 2, 8)]
        assert group["spec"]["workload"]["kind"] == "PodGroup"
        pods = await eventually("both pods placed", lambda: _group_started(kube_api))
        assert {p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods} == {"n0", "n1"}
        await kube_api.run_pods_to_ready(NS_A, "gpuq.io/pod-group=gang", count=2)
        # the user deletes one pod of the running gang: the job is cancelled and the other pod deleted
        await client.delete(Pod, "gang-0", namespace=NS_A)
        cancelled = await eventually("JobCancelled", lambda: bus_events(nats_url, "job.cancelled"))
        assert [c["job_id"] for c in cancelled] == [group["spec"]["job_id"]]
        assert "gang-0 was deleted" in cancelled[0]["reason"]
        await eventually("the other pod deleted", lambda: _gone(kube_api, "gpuq.io/pod-group=gang"))
        assert await fetchval(database_url, "SELECT state FROM executor.kube_jobs WHERE job_id = $1",
                              group["spec"]["job_id"]) == "cancelled"


async def test_preempting_a_plain_pod_checkpoints_then_deletes_it_and_ends_its_job(fresh: tuple[str, str],
                                                                                  kube_api: Any) -> None:
    nats_url, database_url = fresh
    await setup(kube_api)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "preemption", "executor")):
        for name in ("borrow-0", "borrow-1"):  # team-a borrows all of team-b's 16 GPUs
            await client.create(plain_pod(name, annotations={"gpuq.io/checkpoint": "true"}), namespace=NS_A)
        await eventually("both pods started", lambda: started_pods(kube_api, 2))
        await kube_api.run_pods_to_ready(NS_A, STARTED, count=2)
        await client.create(JOB(owner_job()))
        asked = await eventually("the checkpoint requests",
                                 lambda: _annotated(kube_api, "gpuq.io/checkpoint-requested", 2))
        for pod in asked:  # each pod is a job of its own, and answers for itself
            uri = f"s3://checkpoints/{pod['metadata']['name']}/step-3"
            await asyncio.to_thread(gpuq_sdk.report_checkpoint, uri, step=3, pod=pod["metadata"]["name"],
                                    namespace=NS_A, api_url=kube_api.server, token=kube_api.token)
        preempted = await eventually("JobPreempted", lambda: _at_least(nats_url, "job.preempted", 2))
        assert sorted(p["checkpoint_uri"] for p in preempted) == [f"s3://checkpoints/borrow-{i}/step-3"
                                                                  for i in range(2)]
        await eventually("the preempted pods deleted", lambda: _gone(kube_api, STARTED))
        cancelled = await eventually("their jobs ended", lambda: _at_least(nats_url, "job.cancelled", 2))
        ended = {c["job_id"]: c["reason"] for c in cancelled}
        for p in preempted:
            assert "preempted or requeued" in ended[p["job_id"]] and "nothing recreates it" in ended[p["job_id"]]
        assert await fetchval(database_url, "SELECT count(*) FROM executor.kube_jobs WHERE kind = 'Pod' "
                                            "AND state = 'cancelled'") == 2
        # the owner's job runs on what the plain pods held
        await eventually("the owner's pods ungated", lambda: started_pods(kube_api, 2, NS_B))


async def _group_started(kube_api: Any) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(NS_A, "gpuq.io/pod-group=gang") if not p["spec"].get("schedulingGates")]
    return pods if len(pods) == 2 else None


async def _gone(kube_api: Any, labels: str) -> bool:
    return not [p for p in await kube_api.pods(NS_A, labels) if not p["metadata"].get("deletionTimestamp")]


async def _annotated(kube_api: Any, key: str, count: int) -> list[dict[str, Any]] | None:
    pods = [p for p in await kube_api.pods(NS_A, STARTED) if key in p["metadata"].get("annotations", {})]
    return pods if len(pods) == count else None


async def _at_least(nats_url: str, subject: str, count: int) -> list[dict[str, Any]] | None:
    found = await bus_events(nats_url, subject)
    return found if len(found) >= count else None
