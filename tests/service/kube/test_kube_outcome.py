"""Kubernetes sees the outcome (issue 45 item 7), on the fake API server with real NATS and Postgres.

A job gpuq ends (its runtime limit, PodsNotReady past the requeue limit, Lost, a rejection after intake) used to stay
suspended, so kubectl and Kueue-aware tools never read it as failed. Now its workload ends Failed in its kind's own
terms once its controller has stopped it: a batch/v1 Job through the Job controller (DeadlineExceeded: resumed with no
pod to run and a one-second deadline), a JobSet, PyTorchJob or RayJob with the terminal status its controller writes;
gpuq's reason is on the Failed (or Rejected) Event and the `gpuq.io/status` annotation.

And a Pending job's Event carries the ETA with the protection window counted, in the words of `gpuq explain`."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest
from lightkube.generic_resource import create_namespaced_resource

from services.api.readmodel import explain_lines, fetch_status
from services.core.eta.words import eta_words
from shared.config import parse_queues
from tests.kube_support import H100, bus_events, eventually, kube_cluster, kube_stack, workload_events

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}, {"name": "low", "value": 10, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
JOBSET = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
PYTORCHJOB = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")
RAYJOB = create_namespaced_resource("ray.io", "v1", "RayJob", "rayjobs")


def _pod_spec(gpus: int, name: str = "main") -> dict[str, Any]:
    return {"restartPolicy": "Never", "containers": [{"name": name, "image": "ghcr.io/example/x:1", "resources": {
        "limits": {"nvidia.com/gpu": str(gpus)} if gpus else {}, "requests": {"cpu": "2", "memory": "4Gi"}}}]}


def _meta(name: str, priority: str = "normal", max_runtime_s: int | None = None) -> dict[str, Any]:
    annotations = {"gpuq.io/max-runtime-s": str(max_runtime_s)} if max_runtime_s is not None else {}
    return {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a", "gpuq.io/priority-class": priority},
            "annotations": annotations}


def job(name: str, *, pods: int = 1, gpus: int = 8, priority: str = "normal", max_runtime_s: int | None = None
        ) -> Any:
    return JOB({"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, priority, max_runtime_s),
                "spec": {"suspend": True, "completionMode": "Indexed", "completions": pods, "parallelism": pods,
                         "backoffLimit": 0, "template": {"spec": _pod_spec(gpus)}}})


def kubectl_job_status(obj: dict[str, Any]) -> str:
    """The STATUS column of `kubectl get job` (kube-apiserver's table printer, printJob, Kubernetes 1.28+)."""
    def holds(kind: str) -> bool:
        return any(c.get("type") == kind and c.get("status") == "True"
                   for c in (obj.get("status") or {}).get("conditions") or [])

    if holds("Complete"):
        return "Complete"
    if holds("Failed"):
        return "Failed"
    if obj["metadata"].get("deletionTimestamp"):
        return "Terminating"
    if holds("Suspended"):
        return "Suspended"
    if holds("FailureTarget"):
        return "FailureTarget"
    if holds("SuccessCriteriaMet"):
        return "SuccessCriteriaMet"
    return "Running"


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)


async def setup(kube_api: Any, nodes: int = 2) -> Any:
    for i in range(1, nodes + 1):
        kube_api.fake.add_node(f"n{i}", gpus=8, gpu_product=H100)
    await kube_api.create_namespace(NS)
    return kube_api.client()


async def read(client: Any, res: Any, name: str) -> dict[str, Any]:
    return dict((await client.get(res, name, namespace=NS)).to_dict())


async def failed_job(client: Any, name: str) -> dict[str, Any] | None:
    obj = await read(client, JOB, name)
    return obj if kubectl_job_status(obj) == "Failed" else None


async def test_a_job_that_ran_past_its_runtime_limit_is_failed_to_kubectl(fresh: tuple[str, str],
                                                                          kube_api: Any) -> None:
    """gpuq stops a Job that ran past its runtime limit; the Job controller then records it Failed (kubectl prints
    Failed; Kueue's jobframework reads Failed=True as finished), it runs no pod again, and gpuq's reason is on the
    Event and the annotation. (Before: the Job stayed suspended, and kubectl printed Suspended.)"""
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("long", max_runtime_s=2))
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        (failed,) = await eventually("JobFailed", lambda: bus_events(nats_url, "job.failed"), timeout_s=30)
        obj = await eventually("the Job Failed", lambda: failed_job(client, "long"), timeout_s=30)
        events = await workload_events(client, NS, "long")
    assert failed["exit_reason"] == "DeadlineExceeded"
    assert condition(obj, "Failed") is not None and condition(obj, "Failed")["status"] == "True"
    assert condition(obj, "Failed")["reason"] == "DeadlineExceeded"  # the Job controller's words
    assert obj["spec"]["parallelism"] == 0 and obj["spec"]["activeDeadlineSeconds"] == 1
    assert [p for p in await kube_api.pods(NS, "gpuq.io/job") if not p["metadata"].get("deletionTimestamp")] == []
    assert obj["metadata"]["annotations"]["gpuq.io/status"] == "Failed: DeadlineExceeded"
    (said,) = [e for e in events if e["reason"] == "Failed"]
    assert said["type"] == "Warning" and said["message"].startswith("DeadlineExceeded: ") \
        and "max_runtime_s=2" in said["message"]
    # the user's template is back as written (no gate, no node of gpuq's placement)
    assert not obj["spec"]["template"]["spec"].get("schedulingGates")
    assert not obj["spec"]["template"]["spec"].get("nodeSelector")


async def test_a_gang_never_ready_past_the_requeue_limit_is_failed_to_kubectl(fresh: tuple[str, str],
                                                                              kube_api: Any) -> None:
    """PodsNotReady past `requeue_limit` ends the job: the Job reads Failed too."""
    nats_url, database_url = fresh
    client = await setup(kube_api)
    kube_api.fake.kubelet.start_pods = False  # bound, never started
    cluster = kube_cluster(pods_ready_timeout_s=1.0, requeue_backoff_s=1.0, requeue_limit=0)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("stuck", pods=2))
        (failed,) = await eventually("JobFailed", lambda: bus_events(nats_url, "job.failed"), timeout_s=60)
        obj = await eventually("the Job Failed", lambda: failed_job(client, "stuck"), timeout_s=30)
    assert failed["exit_reason"] == "PodsNotReady"
    assert obj["metadata"]["annotations"]["gpuq.io/status"] == "Failed: PodsNotReady"


async def test_a_job_admission_rejects_after_intake_is_failed_to_kubectl(fresh: tuple[str, str],
                                                                         kube_api: Any) -> None:
    """Taken in, then refused by admission (more GPUs than its queue can ever hold): never resumed, it is ended at
    once; the Rejected Event and the annotation say why."""
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("huge", pods=3))  # 24 GPUs; the queue holds 16 at most
        (rejected,) = await eventually("JobRejected", lambda: bus_events(nats_url, "job.rejected"))
        obj = await eventually("the Job Failed", lambda: failed_job(client, "huge"), timeout_s=30)
        events = await workload_events(client, NS, "huge")
    assert rejected["reason"] == "InadmissibleExceedsLimits"
    assert obj["metadata"]["annotations"]["gpuq.io/status"].startswith("Rejected: InadmissibleExceedsLimits: ")
    assert [e["message"] for e in events if e["reason"] == "Rejected"] == [
        f"InadmissibleExceedsLimits: {rejected['message']}"]
    assert await bus_events(nats_url, "job.placed") == []


def _jobset(name: str) -> Any:
    return JOBSET({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(name, max_runtime_s=2),
                   "spec": {"suspend": True, "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {
                       "spec": {"parallelism": 1, "completions": 1, "template": {"spec": _pod_spec(8)}}}}]}})


def _pytorchjob(name: str) -> Any:
    return PYTORCHJOB({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(name, max_runtime_s=2),
                       "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {"Worker": {
                           "replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(8, "pytorch")}}}}})


def _rayjob(name: str) -> Any:
    return RAYJOB({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _meta(name, max_runtime_s=2),
                   "spec": {"suspend": True, "entrypoint": "python tune.py", "rayClusterSpec": {
                       "headGroupSpec": {"rayStartParams": {}, "template": {"spec": _pod_spec(0, "ray-head")}},
                       "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                             "rayStartParams": {},
                                             "template": {"spec": _pod_spec(8, "ray-worker")}}]}}})


def _jobset_failed(obj: dict[str, Any]) -> bool:
    """`kubectl get jobset` prints TERMINALSTATE Failed; the Failed condition is what Kueue's JobSet adapter reads."""
    failed = condition(obj, "Failed")
    return obj.get("status", {}).get("terminalState") == "Failed" and failed is not None and failed["status"] == "True"


def _pytorchjob_failed(obj: dict[str, Any]) -> bool:
    """`kubectl get pytorchjob` prints STATE from the last condition's type; the training operator's Failed=True."""
    conditions = obj.get("status", {}).get("conditions") or []
    return bool(conditions) and conditions[-1]["type"] == "Failed" and conditions[-1]["status"] == "True"


def _rayjob_failed(obj: dict[str, Any]) -> bool:
    """`kubectl get rayjob` prints DEPLOYMENT STATUS Failed, what KubeRay and Kueue's RayJob adapter read."""
    return obj.get("status", {}).get("jobDeploymentStatus") == "Failed"


@pytest.mark.parametrize(("make", "res", "is_failed"), [
    (_jobset, JOBSET, _jobset_failed), (_pytorchjob, PYTORCHJOB, _pytorchjob_failed), (_rayjob, RAYJOB, _rayjob_failed),
], ids=["jobset", "pytorchjob", "rayjob"])
async def test_a_custom_workload_gpuq_fails_ends_with_its_controllers_failed_status(
        fresh: tuple[str, str], kube_api: Any, make: Any, res: Any, is_failed: Any) -> None:
    """A JobSet, PyTorchJob or RayJob that ran past its runtime limit: once its controller has stopped it, gpuq
    writes the failed status that controller writes, with gpuq's reason, which the controller leaves alone."""
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(make("run"))
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        (failed,) = await eventually("JobFailed", lambda: bus_events(nats_url, "job.failed"), timeout_s=30)

        async def ended() -> dict[str, Any] | None:
            obj = await read(client, res, "run")
            return obj if is_failed(obj) else None

        obj = await eventually("the workload failed", ended, timeout_s=30)
        await kube_api.settle()
        obj = await read(client, res, "run")  # its controller kept it so
    assert failed["exit_reason"] == "DeadlineExceeded" and is_failed(obj)
    reason = condition(obj, "Failed")["reason"] if condition(obj, "Failed") else obj["status"]["reason"]
    assert reason == "DeadlineExceeded"
    assert obj["metadata"]["annotations"]["gpuq.io/status"] == "Failed: DeadlineExceeded"
    assert [p for p in await kube_api.pods(NS, "gpuq.io/job") if not p["metadata"].get("deletionTimestamp")] == []


async def test_a_pending_jobs_event_carries_the_eta_with_the_protection_window_counted(
        fresh: tuple[str, str], kube_api: Any) -> None:
    """The queue's quota (16) is more than the one node holds (8). A low-priority Job holds the node for a day; a
    normal Job is admitted but cannot be placed, so the scheduler asks for preemption, which the platform grants when
    the low Job's protection window (600 s) ends: ten minutes, not a day. Its Pending Event says so, in the same words
    as `gpuq explain`. (Before: the ETA was the low Job's end, 24 h away, and the Event wrote the range otherwise.)"""
    nats_url, database_url = fresh
    client = await setup(kube_api, nodes=1)
    window = QUEUES.policy.protection_window_s
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("holder", priority="low", max_runtime_s=86_400))
        await eventually("the holder started", lambda: bus_events(nats_url, "job.started"))
        await client.create(job("waiter"))
        conn = await asyncpg.connect(database_url)
        try:
            async def eta() -> Any:
                return await conn.fetchrow("SELECT a.eta, a.eta_low, a.eta_high FROM admission.jobs a "
                                           "WHERE a.job_id LIKE 'ml-team-a.waiter.%' AND a.eta IS NOT NULL")

            row = await eventually("the waiter's ETA", eta, timeout_s=90)
            start = await conn.fetchval("SELECT p.expected_end - (p.spec->>'max_runtime_s')::float8 "
                                        "FROM scheduler.v1_placements p WHERE p.job_id LIKE 'ml-team-a.holder.%'")
            words = eta_words(row["eta"], row["eta_low"], row["eta_high"])

            async def pending() -> Any:
                return [e for e in await workload_events(client, NS, "waiter")
                        if e["reason"] == "Pending" and words in e["message"]]

            (event,) = await eventually("the Pending Event with the ETA", pending)
            job_id = await conn.fetchval("SELECT job_id FROM admission.jobs WHERE job_id LIKE 'ml-team-a.waiter.%'")
            (status,) = await fetch_status(database_url, job_id)
            explained = "\n".join(explain_lines(status, row["eta"]))
        finally:
            await conn.close()
    # the holder's protection ends `window` after its start: the reclaim is due then, not at its end a day later
    assert start + window - 5 <= row["eta"] <= start + window + 5
    assert f"expected start {words}" in event["message"] and " UTC" in words  # zoned times
    assert f"expected start {words}" in explained  # the same start and range as `gpuq explain`
