"""The Kubernetes executor against an API server (the fake, or GPUQ_KUBECONFIG's cluster for the tests that do not
drive the fake's actors) with real NATS and Postgres: the informer's relist after 410, PodsReady timeout and
requeue with backoff, OOMKilled, the runtime limit, a node going NotReady, an event-submitted job becoming an
Indexed Job, and refusals with Events."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import nats
from lightkube.generic_resource import create_namespaced_resource

from services.executor.kube.client import NODE, POD, KubeApi, load_config
from services.executor.kube.informer import Informer
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet, PodTemplate
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from tests.kube_support import (
    BLOCK,
    H100,
    RACK,
    bus_events,
    eventually,
    fetchval,
    kube_cluster,
    kube_stack,
    workload_events,
)

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def job(name: str, *, pods: int = 1, gpus: int = 8, namespace: str = NS, suspend: bool = True,
        annotations: dict[str, str] | None = None) -> Any:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "4", "memory": "8Gi"}}}
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": namespace, "labels": {"gpuq.io/queue": "team-a"},
                             "annotations": annotations or {}},
                "spec": {"suspend": suspend, "completionMode": "Indexed", "completions": pods, "parallelism": pods,
                         "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never",
                                                                 "containers": [container]}}}})


async def setup(kube_api: Any, nodes: tuple[str, ...] = ("n1", "n2")) -> Any:
    for name in nodes:
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    await kube_api.create_namespace(NS)
    return kube_api.client()


async def events_of(nats_url: str, fact: str, job_id: str | None = None) -> list[dict[str, Any]]:
    return [e for e in await bus_events(nats_url, f"job.{fact}") if job_id is None or e["job_id"] == job_id]


async def live_pods(kube_api: Any) -> list[dict[str, Any]]:
    return [p for p in await kube_api.pods(NS, "gpuq.io/job") if not p["metadata"].get("deletionTimestamp")]


async def test_informer_relists_after_410_and_reports_what_it_missed(kube_api: Any) -> None:
    fake = kube_api.fake
    for name in ("n1", "n2", "n3"):
        fake.add_node(name, gpus=8, gpu_product=H100)
    api = KubeApi(load_config(kube_api.kubeconfig))
    seen: list[tuple[str, str]] = []

    async def on_change(kind: str, obj: dict[str, Any]) -> None:
        seen.append((kind, obj["metadata"]["name"]))

    informer = Informer(api, NODE, on_change, resync_s=300)
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        assert sorted(seen) == [("ADDED", "n1"), ("ADDED", "n2"), ("ADDED", "n3")] and informer.relists == 1
        # The watch ends; meanwhile n2 goes and the history is compacted past it: resuming gets 410 Gone.
        fake.store.close_all_watches()
        fake.store.delete(fake_nodes(), None, "n2")
        fake.store.compact(expire_watches=False)
        await eventually("the relist", lambda: _true(informer.relists == 2))
        await eventually("n2 reported deleted", lambda: _true(("DELETED", "n2") in seen))
        assert informer.expired == 1  # through 410 Gone, not a generic failure
        assert sorted(k.split("/")[1] for k in informer.cache) == ["n1", "n3"]
        fake.add_node("n4", gpus=8)  # and the new watch runs from the relist's resourceVersion
        await eventually("n4 added", lambda: _true(("ADDED", "n4") in seen))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()


def fake_nodes() -> Any:
    from tests.kube.kubefake.resources import NODES  # the fake's own resource table (test-side only)

    return NODES


async def _true(value: bool) -> bool:
    return value


async def test_gang_not_ready_in_time_is_requeued_with_backoff_then_fails(fresh: tuple[str, str],
                                                                           kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    kube_api.fake.kubelet.start_pods = False  # the pods are bound but never start
    cluster = kube_cluster(pods_ready_timeout_s=1.0, requeue_backoff_s=1.0, requeue_limit=1)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("stuck", pods=2))
        failed = await eventually("JobFailed", lambda: events_of(nats_url, "failed"), timeout_s=60)
    assert failed[0]["exit_reason"] == "PodsNotReady" and "gave up after 1 requeue" in failed[0]["message"]
    preempted = await events_of(nats_url, "preempted")
    assert [p["reason"] for p in preempted] == ["PodsReadyTimeout"]
    assert len(await events_of(nats_url, "placed")) == 2  # requeued once, placed again
    row = await fetchval(database_url, "SELECT row_to_json(j)::text FROM executor.kube_jobs j")
    state = json.loads(row)
    assert state["requeues"] == 2 and state["attempt"] == 2 and state["state"] == "failed"
    # the second attempt started only when its backoff (1 s after the first timeout) was over
    assert state["placed_at"] >= state["backoff_until"]


async def test_oom_killed_pod_fails_the_job_with_its_reason(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("greedy"))
        await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        (pod,) = await live_pods(kube_api)
        kube_api.fake.kubelet.oom_kill(NS, pod["metadata"]["name"])
        (failed,) = await eventually("JobFailed", lambda: events_of(nats_url, "failed"))
    assert failed["exit_reason"] == "OOMKilled" and "OOMKilled (exit code 137)" in failed["message"]
    reasons = [e["reason"] for e in await workload_events(client, NS, "greedy")]
    assert "Failed" in reasons


async def test_runtime_limit_is_enforced_by_the_executor(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("long", annotations={"gpuq.io/max-runtime-s": "2"}))
        await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        (failed,) = await eventually("JobFailed", lambda: events_of(nats_url, "failed"), timeout_s=30)

        async def stopped() -> bool:
            return not await live_pods(kube_api)

        await eventually("its pods stopped", stopped)  # (and the Job ends Failed: test_kube_outcome.py)
    assert failed["exit_reason"] == "DeadlineExceeded" and "max_runtime_s=2" in failed["message"]


async def test_node_not_ready_requeues_checkpointed_jobs_and_fails_the_others(fresh: tuple[str, str],
                                                                              kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("saver", gpus=4, annotations={"gpuq.io/checkpoint": "true"}))
        await client.create(job("plain", gpus=4))
        started = await eventually("both started", lambda: _count(events_of(nats_url, "started"), 2))
        (node,) = {n for e in started for n in e["nodes"]}  # binpacked onto one node
        other = "n2" if node == "n1" else "n1"
        saver = next(p for p in await live_pods(kube_api) if p["metadata"]["name"].startswith("saver"))
        await client.patch(POD, saver["metadata"]["name"], {"metadata": {"annotations": {
            "gpuq.io/last-checkpoint": "s3://ckpt/saver/9"}}}, namespace=NS, patch_type=_merge())
        await eventually("JobCheckpointed", lambda: events_of(nats_url, "checkpointed"))

        kube_api.fake.kubelet.set_node_ready(node, False)
        (preempted,) = await eventually("the checkpointed job requeued", lambda: events_of(nats_url, "preempted"))
        (failed,) = await eventually("the other failed", lambda: events_of(nats_url, "failed"))
        assert preempted["reason"] == "NodeFailure" and preempted["checkpoint_uri"] == "s3://ckpt/saver/9"
        assert failed["exit_reason"] == "NodeFailure" and failed["job_id"] != preempted["job_id"]
        changed = [e for e in await bus_events(nats_url, "node.changed") if e["node"]["name"] == node]
        assert changed and changed[-1]["node"]["health"] == "failed"

        async def moved() -> Any:
            pods = [p for p in await live_pods(kube_api) if p["metadata"]["name"].startswith("saver")
                    and not p["spec"].get("schedulingGates")
                    and p["metadata"]["annotations"].get("gpuq.io/binding", "").startswith("2/")]
            return pods or None

        (again,) = await eventually("the requeued job on the other node", moved)
        assert again["spec"]["nodeSelector"]["kubernetes.io/hostname"] == other
        assert again["metadata"]["annotations"]["gpuq.io/resume-from"] == "s3://ckpt/saver/9"


async def _count(value: Any, n: int) -> Any:
    items = await value
    return items if len(items) >= n else None


def _merge() -> Any:
    from lightkube.types import PatchType

    return PatchType.MERGE


async def test_event_submitted_pod_template_runs_as_an_indexed_job(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    spec = JobSpec(job_id="pipeline:eval-7", team="team-a", queue="team-a", pod_sets=(PodSet(
        count=2, gpus_per_pod=4, cpu_milli=4000, memory_mib=8192,
        template=PodTemplate(image="ghcr.io/example/eval:3", command=("python", "eval.py"))),))
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        nc = await nats.connect(nats_url)
        now = datetime.now(UTC)
        await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=now), source="pipeline",
                                                       time=now), JobSubmitted.scoped_subject(spec.team))
        await nc.close()
        await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        jobs = [j async for j in client.list(JOB, namespace=NS)]
        assert len(jobs) == 1
        created = jobs[0]
        assert created["spec"]["completionMode"] == "Indexed" and created["spec"]["completions"] == 2
        assert created["metadata"]["annotations"]["gpuq.io/job-id"] == "pipeline:eval-7"
        container = created["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == "ghcr.io/example/eval:3"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
        await kube_api.complete_pods(NS, "gpuq.io/job")
        (done,) = await eventually("JobCompleted", lambda: events_of(nats_url, "completed"))
    assert done["job_id"] == "pipeline:eval-7"


async def test_unmapped_namespace_and_unsuspended_workloads_are_refused_with_events(fresh: tuple[str, str],
                                                                                    kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    await kube_api.create_namespace("scratch")
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("stray", namespace="scratch"))
        await client.create(job("eager", suspend=False))

        async def refusals() -> Any:
            stray = [e for e in await workload_events(client, "scratch", "stray") if e["type"] == "Warning"]
            eager = [e for e in await workload_events(client, NS, "eager") if e["type"] == "Warning"]
            return (stray, eager) if stray and eager else None

        stray, eager = await eventually("both refusals", refusals)
    assert stray[0]["reason"] == "UnmappedNamespace" and "namespace scratch is not mapped" in stray[0]["message"]
    assert eager[0]["reason"] == "NotSuspended"
    assert await events_of(nats_url, "submitted") == []
    obj = await client.get(JOB, "stray", namespace="scratch")
    assert obj["spec"]["suspend"] is True  # left alone


JOBSET = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
RAYJOB = create_namespaced_resource("ray.io", "v1", "RayJob", "rayjobs")


def _pod_spec(gpus: int, name: str = "main") -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"restartPolicy": "Never", "containers": [{"name": name, "image": "ghcr.io/example/x:1", "resources": {
        "limits": limits, "requests": {"cpu": "2", "memory": "4Gi"}}}]}


async def test_jobset_runs_each_replicated_job_where_placed(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": "pretrain", "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
              "spec": {"suspend": True, "replicatedJobs": [
                  {"name": "driver", "replicas": 1, "template": {"spec": {
                      "parallelism": 1, "completions": 1, "template": {"spec": _pod_spec(0)}}}},
                  {"name": "workers", "replicas": 2, "template": {"spec": {
                      "parallelism": 1, "completions": 1, "template": {"spec": _pod_spec(8)}}}}]}}
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(JOBSET(jobset))
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        pods = await live_pods(kube_api)
        assert sorted(p["metadata"]["labels"]["gpuq.io/pod-set"] for p in pods) == ["driver", "workers", "workers"]
        workers = sorted(p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods
                         if p["metadata"]["labels"]["gpuq.io/pod-set"] == "workers")
        assert workers == ["n1", "n2"] and sorted(started["nodes"]) == ["n1", "n2"]
        await kube_api.complete_pods(NS, "gpuq.io/job")
        (done,) = await eventually("JobCompleted", lambda: events_of(nats_url, "completed"))
    assert done["job_id"] == started["job_id"]


async def test_rayjob_head_and_workers_run_where_placed(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    rayjob = {"apiVersion": "ray.io/v1", "kind": "RayJob",
              "metadata": {"name": "tune", "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
              "spec": {"suspend": True, "entrypoint": "python tune.py", "rayClusterSpec": {
                  "headGroupSpec": {"rayStartParams": {}, "template": {"spec": _pod_spec(0, "ray-head")}},
                  "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2,
                                        "rayStartParams": {}, "template": {"spec": _pod_spec(4, "ray-worker")}}]}}}
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(RAYJOB(rayjob))
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        pods = await live_pods(kube_api)
        assert sorted(p["metadata"]["labels"]["gpuq.io/pod-set"] for p in pods) == ["gpu", "gpu", "head"]
        assert all(not p["spec"].get("schedulingGates") for p in pods)
        ray = next(c for c in kube_api.fake.controllers if type(c).__name__.startswith("RayJob"))
        ray.finish(NS, "tune", succeeded=False, message="entrypoint exited with 1")
        (failed,) = await eventually("JobFailed", lambda: events_of(nats_url, "failed"))
    assert failed["job_id"] == started["job_id"] and "entrypoint exited with 1" in failed["message"]


async def test_pod_that_cannot_bind_where_placed_is_placed_elsewhere_next(fresh: tuple[str, str],
                                                                          kube_api: Any) -> None:
    nats_url, database_url = fresh
    # n1 takes one pod, and a DaemonSet's pod already runs there: a limit gpuq does not model (it counts GPUs, CPU
    # and memory), so gpuq places there (binpack: the first node by rank) and kube-scheduler refuses the pod.
    kube_api.fake.add_node("n1", gpus=8, gpu_product=H100, pods=1, labels={BLOCK: "b1", RACK: "r1"})
    kube_api.fake.add_node("n2", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    await kube_api.create_namespace("other")
    await client.create(POD({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent", "namespace": "other"},
                             "spec": {"nodeName": "n1", **_pod_spec(0)}}))
    # requeue_limit 0: a placement failure is no PodsReady requeue, it neither counts nor backs off
    cluster = kube_cluster(requeue_backoff_s=600, requeue_limit=0, bind_timeout_s=1.0)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("blocked"))
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"), timeout_s=60)
        placed = await events_of(nats_url, "placed")
        preempted = await events_of(nats_url, "preempted")
        notes: dict[str, list[str]] = {}
        for e in await workload_events(client, NS, "blocked"):
            notes.setdefault(e["reason"], []).append(e["message"])
        refusals = [e for e in await bus_events(nats_url, "node.changed") if e.get("reason") == "PlacementRefused"]
    assert started["nodes"] == ["n2"] and [b["node"] for b in placed[0]["bindings"]] == ["n1"]
    assert [p["reason"] for p in preempted] == ["PlacementFailed"] * len(preempted) and len(placed) == 2
    assert await events_of(nats_url, "failed") == []
    (unschedulable,) = notes["Unschedulable"]
    assert "cannot run on n1" in unschedulable and "Too many pods" in unschedulable
    (requeued,) = [m for m in notes["Requeued"] if m.startswith("PlacementFailed")]
    assert requeued.startswith("PlacementFailed: pod blocked-") and requeued.endswith(
        "(for 1 s); n1 gets no such pod until what runs there changes")
    (refusal,) = refusals[0]["node"]["refused"]
    assert refusals[0]["node"]["name"] == "n1" and refusal["reason"] == "Unschedulable"
    assert refusal["shape"] == {"gpus": 8, "mig_profile": None, "cpu_milli": 4000, "memory_mib": 8192}
    assert refusal["usage"]["pods"] == 1  # the DaemonSet's pod: when it goes, n1 is tried again
