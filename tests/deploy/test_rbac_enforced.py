"""The chart's roles are exactly what gpuq uses: the executor and the API run with the identities the rendered chart
gives them (its ServiceAccounts, ClusterRoles and bindings applied to the fake API server of tests/kube/kubefake,
which enforces RBAC), on real NATS and Postgres. Every kind of workload the executor handles runs without one
Forbidden, and the access log shows every granted verb used: nothing missing, nothing to spare. It changes things
only in the namespaces gpuq manages: elsewhere (the release's own namespace, a namespace no team has) it can read
but not create or patch. Without `rbac.eventSubmittedJobs`, a job submitted as an event fails at once with the API
server's refusal, and workloads created in the cluster still run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from lightkube import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Namespace, Pod, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding, RoleBinding

from services.executor.kube.client import EVENT, POD, KubeApi, load_config
from services.stack import Stack, StackSettings
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet, PodTemplate
from shared.events import JobSubmitted, make_event
from shared.servers import free_port
from shared.service import publish_event
from tests.deploy.test_chart import CI_VALUES, EXECUTOR_RULES, READ_VERBS, WORKLOADS
from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import JOBS
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster

NS = "ml-team-a"
RELEASE_NS = "gpuq-system"
# The chart rendered for this cluster: the CI values, with the test's team namespace managed as well.
MANAGED = f"rbac.managedNamespaces={{{NS}}}"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")
JOBSET = create_namespaced_resource("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
PYTORCHJOB = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")
TFJOB = create_namespaced_resource("kubeflow.org", "v1", "TFJob", "tfjobs")
MPIJOB = create_namespaced_resource("kubeflow.org", "v2beta1", "MPIJob", "mpijobs")
RAYJOB = create_namespaced_resource("ray.io", "v1", "RayJob", "rayjobs")
NOTEBOOK = create_namespaced_resource("kubeflow.org", "v1", "Notebook", "notebooks")
LWS = create_namespaced_resource("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets")
STS = create_namespaced_resource("apps", "v1", "StatefulSet", "statefulsets")


def _pod_spec(gpus: int, name: str = "main") -> dict[str, Any]:
    return {"restartPolicy": "Never", "containers": [{"name": name, "image": "ghcr.io/example/x:1", "resources": {
        "limits": {"nvidia.com/gpu": str(gpus)} if gpus else {}, "requests": {"cpu": "1", "memory": "1Gi"}}}]}


def _labels() -> dict[str, Any]:
    return {"namespace": NS, "labels": {"gpuq.io/queue": "team-a"}}


CLUSTER_WORKLOADS = [
    JOB({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "plain", **_labels()},
         "spec": {"suspend": True, "backoffLimit": 0, "template": {"spec": _pod_spec(1)}}}),
    PYTORCHJOB({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "bert", **_labels()},
                "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {"Worker": {
                    "replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(1, "pytorch")}}}}}),
    RAYJOB({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "tune", **_labels()},
            "spec": {"suspend": True, "entrypoint": "python tune.py", "rayClusterSpec": {
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": _pod_spec(0, "ray-head")}},
                "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                      "rayStartParams": {}, "template": {"spec": _pod_spec(1, "ray-worker")}}]}}}),
]


def _ending(name: str) -> dict[str, Any]:
    """A workload gpuq ends at its runtime limit (2 s): its kind's failed status is written (`<kind>/status`)."""
    return {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"},
            "annotations": {"gpuq.io/max-runtime-s": "2"}}


# One of each custom kind that gpuq fails: it reads as failed through the status its controller writes.
ENDING_WORKLOADS = [
    JOBSET({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _ending("short-set"),
            "spec": {"suspend": True, "replicatedJobs": [{"name": "w", "replicas": 1, "template": {"spec": {
                "parallelism": 1, "completions": 1, "template": {"spec": _pod_spec(1)}}}}]}}),
    PYTORCHJOB({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _ending("short-torch"),
                "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {"Worker": {
                    "replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(1, "pytorch")}}}}}),
    TFJOB({"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": _ending("short-tf"),
           "spec": {"runPolicy": {"suspend": True}, "tfReplicaSpecs": {"Worker": {
               "replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(1, "tensorflow")}}}}}),
    MPIJOB({"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": _ending("short-mpi"),
            "spec": {"runPolicy": {"suspend": True}, "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(0, "launcher")}},
                "Worker": {"replicas": 1, "restartPolicy": "Never", "template": {"spec": _pod_spec(1, "worker")}}}}}),
    # issue 48: a Notebook is started and stopped through its annotation (get, patch), and ends stopped
    NOTEBOOK({"apiVersion": "kubeflow.org/v1", "kind": "Notebook", "metadata": {
        **_ending("short-nb"), "annotations": {"gpuq.io/max-runtime-s": "2", "kubeflow-resource-stopped": "x"}},
        "spec": {"template": {"spec": _pod_spec(1, "lab")}}}),
    # a LeaderWorkerSet is held at zero groups and started with them back (get, patch), and ends held
    LWS({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {
        **_ending("short-lws"), "annotations": {"gpuq.io/max-runtime-s": "2", "gpuq.io/groups": "1"}},
        "spec": {"replicas": 0, "leaderWorkerTemplate": {"size": 1, "workerTemplate": {"spec": _pod_spec(1, "lws")}}}}),
    STS({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {
        **_ending("short-sts"), "annotations": {"gpuq.io/max-runtime-s": "2", "gpuq.io/replicas": "1"}},
        "spec": {"replicas": 0, "serviceName": "short-sts", "selector": {"matchLabels": {"app": "short-sts"}},
                 "template": {"metadata": {"labels": {"app": "short-sts"}}, "spec": _pod_spec(1, "server")}}}),
    # issue 48: a plain pod held by gpuq's gate is read when it is started (get) and deleted when it ends (delete)
    Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "metadata": _ending("short-pod"),
                   "spec": {**_pod_spec(1, "plain"), "schedulingGates": [{"name": "gpuq.io/placement"}]}}),
    RAYJOB({"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _ending("short-ray"),
            "spec": {"suspend": True, "entrypoint": "python tune.py", "rayClusterSpec": {
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": _pod_spec(0, "ray-head")}},
                "workerGroupSpecs": [{"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                      "rayStartParams": {}, "template": {"spec": _pod_spec(1, "ray-worker")}}]}}}),
]


def event_job(job_id: str, pod_sets: int, node: str | None = None) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=tuple(
        PodSet(name=f"set{i}", count=1, gpus_per_pod=1, cpu_milli=1000, memory_mib=1024,
               node_selector={"kubernetes.io/hostname": node} if node else {},
               template=PodTemplate(image="ghcr.io/example/eval:3", command=("python", "eval.py")))
        for i in range(pod_sets)))


async def install_identities(kube_api: KubeCluster, docs: list[dict[str, Any]]) -> None:
    """What `helm install` would create for RBAC: the release namespace, its ServiceAccounts, the ClusterRoles and
    their bindings (RoleBindings in the managed namespaces, which exist before the install), exactly as rendered."""
    client = kube_api.client()
    kinds = {"ServiceAccount": ServiceAccount, "ClusterRole": ClusterRole, "ClusterRoleBinding": ClusterRoleBinding,
             "RoleBinding": RoleBinding}
    namespaces = {RELEASE_NS} | {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"}
    for name in sorted(namespaces):
        if await kube_api.read(_namespaces(), name) is None:
            await client.create(Namespace.from_dict({"metadata": {"name": name}}))
    for doc in docs:
        if doc["kind"] in kinds:
            await client.create(kinds[doc["kind"]].from_dict(doc))


def _namespaces() -> Any:
    from tests.kube.kubefake.resources import NAMESPACES

    return NAMESPACES


async def as_service_account(kube_api: KubeCluster, name: str, tmp_path: Path) -> Path:
    token = await kube_api.service_account_token(RELEASE_NS, name)
    return kube_api.token_kubeconfig(token, tmp_path / f"{name}.kubeconfig")


async def setup_cluster(kube_api: KubeCluster) -> None:
    for i in range(1, 4):
        kube_api.fake.add_node(f"n{i}", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    # a node whose GPUs are DRA devices (resource.k8s.io/v1 ResourceSlices), where an event job claims one
    kube_api.fake.add_node("dra", labels={BLOCK: "b1", RACK: "r1"})
    kube_api.fake.add_gpu_slice("dra", gpus=2)
    if await kube_api.read(_namespaces(), NS) is None:
        await kube_api.create_namespace(NS)


async def submit(nats_url: str, *specs: JobSpec) -> None:
    nc = await nats.connect(nats_url)
    try:
        now = datetime.now(UTC)
        for spec in specs:
            await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=now),
                                                           source="pipeline", time=now),
                                JobSubmitted.scoped_subject(spec.team))
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def executor_stack(nats_url: str, database_url: str, kubeconfig: Path) -> AsyncIterator[Stack]:
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=kube_cluster(),
                             services=("admission", "scheduler", "executor"), executor="kube", kubeconfig=kubeconfig)
    async with Stack(settings) as stack:
        yield stack


async def test_the_executor_and_the_api_run_with_exactly_the_charts_roles(
        render: Any, fresh: tuple[str, str], kube_api: KubeCluster, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    nats_url, database_url = fresh
    auth = kube_api.fake.http.api.auth
    docs = render(CI_VALUES, sets=[MANAGED])
    await install_identities(kube_api, docs)
    await setup_cluster(kube_api)
    executor_config = await as_service_account(kube_api, "gpuq-executor", tmp_path)
    client = kube_api.client()
    async with kube_api.autopilot(), executor_stack(nats_url, database_url, executor_config):
        for workload in CLUSTER_WORKLOADS:
            await client.create(workload)
        await submit(nats_url, event_job("event-job", 1), event_job("event-jobset", 2),
                     event_job("event-dra", 1, node="dra"))
        started = await eventually("every job started", lambda: _at_least(bus_events(nats_url, "job.started"), 6),
                                   timeout_s=90)
        assert len({e["job_id"] for e in started}) == 6
        assert await bus_events(nats_url, "job.failed") == []
        for workload in ENDING_WORKLOADS:
            await client.create(workload)
        failed = await eventually("the short ones failed", lambda: _at_least(bus_events(nats_url, "job.failed"), 9),
                                  timeout_s=90)
        assert sorted(e["job_id"].split(".")[1] for e in failed) == ["short-lws", "short-mpi", "short-nb",
                                                                     "short-pod", "short-ray", "short-set",
                                                                     "short-sts", "short-tf", "short-torch"]
        await eventually("each shown failed", lambda: _all_shown_failed(client))
    executor_user = f"system:serviceaccount:{RELEASE_NS}:gpuq-executor"
    refused = [a for a in auth.log if a.user == executor_user and not a.allowed]
    assert refused == []
    # Every verb the role grants was needed, and nothing it does not grant was asked for.
    assert auth.used_by(executor_user) == EXECUTOR_RULES
    # It changed things only in the team's namespace.
    assert {a.namespace for a in auth.log if a.user == executor_user and a.verb not in READ_VERBS} == {NS}

    # The API reviews a pipeline's token with its own identity, which may do that and nothing else.
    monkeypatch.setenv("GPUQ_API_TOKEN_REVIEW", "true")
    monkeypatch.setenv("GPUQ_API_TOKEN_AUDIENCES", "gpuq")
    await kube_api.create_service_account(NS, "pipeline")
    pipeline = await kube_api.service_account_token(NS, "pipeline", audiences=("gpuq",))
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, services=("api",),
                             api_port=port, kubeconfig=await as_service_account(kube_api, "gpuq-api", tmp_path))
    async with Stack(settings), httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        async def listed() -> Any:
            try:
                r = await http.get("/v1/jobs", headers={"Authorization": f"Bearer {pipeline}"})
            except httpx.HTTPError:
                return None
            return r if r.status_code != 503 else None

        r = await eventually("the API answering", listed)
        assert r.status_code == 200, r.text
        assert {j["job_id"] for j in r.json()} >= {"event-job", "event-jobset"}
    assert auth.used_by(f"system:serviceaccount:{RELEASE_NS}:gpuq-api") == {
        ("authentication.k8s.io", "tokenreviews"): {"create"}}


async def test_without_event_submitted_jobs_such_a_job_fails_at_once_and_cluster_workloads_still_run(
        render: Any, fresh: tuple[str, str], kube_api: KubeCluster, tmp_path: Path) -> None:
    nats_url, database_url = fresh
    docs = render(CI_VALUES, sets=["rbac.eventSubmittedJobs=false", MANAGED])
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "gpuq-executor-workloads")
    assert all("create" not in r["verbs"] for r in role["rules"] if (r["apiGroups"][0], r["resources"][0]) in
               WORKLOADS)
    await install_identities(kube_api, docs)
    await setup_cluster(kube_api)
    client = kube_api.client()
    async with kube_api.autopilot(), executor_stack(nats_url, database_url,
                                                    await as_service_account(kube_api, "gpuq-executor", tmp_path)):
        await client.create(CLUSTER_WORKLOADS[0])
        await submit(nats_url, event_job("event-job", 1))
        (failed,) = await eventually("the event job failed", lambda: bus_events(nats_url, "job.failed"))
        (started,) = await eventually("the cluster's Job started", lambda: bus_events(nats_url, "job.started"))
    assert failed["job_id"] == "event-job"
    assert "cannot create Job ml-team-a/" in failed["message"] and "forbidden" in failed["message"]
    assert started["job_id"].startswith(f"{NS}.plain.")


async def test_outside_the_managed_namespaces_the_executor_can_read_but_not_create_or_patch(
        render: Any, kube_api: KubeCluster, tmp_path: Path) -> None:
    """The namespace escape, at the API server: were a job to name `gpuq-system` (or a namespace no team has), the
    executor's own identity could not create its Job there, nor patch a pod, nor write an Event; reading nodes and
    pods everywhere, which placement needs, stays."""
    await install_identities(kube_api, render(CI_VALUES, sets=[MANAGED]))
    await setup_cluster(kube_api)
    await kube_api.create_namespace("unmapped")
    admin = kube_api.client()
    for ns in (RELEASE_NS, "unmapped", NS):
        await admin.create(Pod.from_dict({"metadata": {"name": "p", "namespace": ns},
                                          "spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]}}))
    executor = KubeApi(load_config(await as_service_account(kube_api, "gpuq-executor", tmp_path)))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "escape"}, "spec": {"suspend": True,
           "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox:1.36"}]}}}}
    patch = {"metadata": {"annotations": {"gpuq.io/checkpoint-requested": "now"}}}
    try:
        for ns in (RELEASE_NS, "unmapped"):
            for call in (executor.create(JOB, {**job, "metadata": {"name": "escape", "namespace": ns}}, namespace=ns),
                         executor.patch(POD, "p", patch, namespace=ns),
                         executor.patch(JOB, "absent", {"spec": {"suspend": False}}, namespace=ns),
                         executor.create(EVENT, {"metadata": {"name": "e", "namespace": ns}, "reason": "x",
                                                 "involvedObject": {"kind": "Pod", "name": "p", "namespace": ns}},
                                         namespace=ns)):
                with pytest.raises(ApiError) as refused:
                    await call
                assert refused.value.status.code == 403, (ns, refused.value.status.message)
        pods, _ = await executor.list(POD)  # every namespace
        assert {p["metadata"]["namespace"] for p in pods} >= {RELEASE_NS, "unmapped", NS}
        assert (await executor.patch(POD, "p", patch, namespace=NS))["metadata"]["annotations"] == \
            patch["metadata"]["annotations"]
    finally:
        await executor.close()
    assert await kube_api.read(JOBS, "escape", RELEASE_NS) is None


async def _all_shown_failed(client: Any) -> bool:
    """Each custom workload gpuq failed has its controller's failed status (test_kube_outcome.py checks them)."""
    jobset = (await client.get(JOBSET, "short-set", namespace=NS)).to_dict()
    torch = (await client.get(PYTORCHJOB, "short-torch", namespace=NS)).to_dict()
    ray = (await client.get(RAYJOB, "short-ray", namespace=NS)).to_dict()
    kubeflow = [torch, (await client.get(TFJOB, "short-tf", namespace=NS)).to_dict(),
                (await client.get(MPIJOB, "short-mpi", namespace=NS)).to_dict()]
    notebook = (await client.get(NOTEBOOK, "short-nb", namespace=NS)).to_dict()
    lws = (await client.get(LWS, "short-lws", namespace=NS)).to_dict()
    return ("kubeflow-resource-stopped" in notebook["metadata"]["annotations"]  # a Notebook ends stopped
            and lws["spec"]["replicas"] == 0  # a LeaderWorkerSet ends held
            and (await client.get(STS, "short-sts", namespace=NS)).to_dict()["spec"]["replicas"] == 0
            and jobset.get("status", {}).get("terminalState") == "Failed"
            and all((k.get("status", {}).get("conditions") or [{}])[-1].get("type") == "Failed" for k in kubeflow)
            and ray.get("status", {}).get("jobDeploymentStatus") == "Failed")


async def _at_least(events: Any, count: int) -> Any:
    found = await events
    return found if len({e["job_id"] for e in found}) >= count else None
