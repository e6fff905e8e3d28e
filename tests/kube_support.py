"""Helpers for tests of the Kubernetes executor: a platform (real NATS + Postgres) whose executor is the Kubernetes
one, pointed at the `kube_api` fixture's API server (the fake, or GPUQ_KUBECONFIG's cluster)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats

from services.stack import Stack, StackSettings
from shared.config import ClusterConfig, DcgmSettings, QueuesConfig, parse_cluster
from shared.namespace import subject as ns_subject

H100 = "NVIDIA-H100-80GB-HBM3"
BLOCK = "network.topology.nvidia.com/block"
RACK = "network.topology.nvidia.com/rack"


def kube_cluster(namespace: str | None = None, **kube: Any) -> ClusterConfig:
    return parse_cluster({"source": "kubernetes", "kubernetes": {
        "gpu_flavors": {H100: "H100-80GB"}, "topology_levels": [BLOCK, RACK], "namespace": namespace, **kube}})


def kube_stack(nats_url: str, database_url: str, queues: QueuesConfig, cluster: ClusterConfig, kubeconfig: Any,
               services: tuple[str, ...] = ("admission", "scheduler", "executor"),
               dcgm: DcgmSettings | None = None) -> Stack:
    return Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=queues, cluster=cluster,
                               services=services, executor="kube", kubeconfig=kubeconfig, dcgm=dcgm))


async def eventually(what: str, check: Callable[[], Awaitable[Any]], timeout_s: float = 60.0,
                     settle: Callable[[], Awaitable[None]] | None = None) -> Any:
    """Poll `check` until it returns something truthy (settling the fake cluster first, when given)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        if settle is not None:
            await settle()
        result = await check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.1)


async def bus_events(nats_url: str, subject: str) -> list[dict[str, Any]]:
    """Every event on a subject so far (an ordered consumer from the start of the stream). `subject` is below the
    platform namespace: "job.started"."""
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().subscribe(ns_subject(subject), ordered_consumer=True)
    out = []
    while True:
        try:
            out.append(json.loads((await sub.next_msg(timeout=0.5)).data)["data"])
        except TimeoutError:
            break
    await nc.close()
    return out


async def fetchval(database_url: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def workload_events(client: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """The core/v1 Events about object `name` (what `kubectl describe` shows)."""
    from lightkube.resources.core_v1 import Event

    out = []
    async for e in client.list(Event, namespace=namespace):
        d = e.to_dict()
        if d["involvedObject"].get("name") == name:
            out.append(d)
    return out


async def set_node(client: Any, name: str, patch: dict[str, Any]) -> None:
    from lightkube.types import PatchType

    from services.executor.kube.client import NODE  # generic: no typed decoding of the reply

    await client.patch(NODE, name, patch, patch_type=PatchType.MERGE)


# ----------------------------------------------------------------------------- workloads of every kind

def template(gpus: int = 0, *, init_gpus: int = 0, requests_only: bool = False,
             labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod template; its GPUs as limits (or requests only), on the main container or on an init container."""
    def resources(count: int) -> dict[str, Any]:
        gpus_of = {"nvidia.com/gpu": str(count)} if count else {}
        return {"requests": gpus_of} if requests_only else {"limits": gpus_of}

    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [
        {"name": "main", "image": "ghcr.io/example/train:1", "command": ["sleep", "30"], "resources": resources(gpus)}]}
    if init_gpus:
        spec["initContainers"] = [{"name": "warm", "image": "ghcr.io/example/train:1", "command": ["true"],
                                   "resources": resources(init_gpus)}]
    return {"metadata": {"labels": labels or {}}, "spec": spec}


def kind_body(kind: str, name: str, gpu: bool) -> dict[str, Any]:
    """A workload of `kind` created running, whose GPUs (when `gpu`) are in its last pod template only, where a
    check that reads the first template alone would miss them."""
    last = template(1) if gpu else template()
    if kind == "Job":  # the GPU on an init container, as requests only
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": {
            "suspend": False, "backoffLimit": 0,
            "template": template(init_gpus=1, requests_only=True) if gpu else template()}}
    if kind == "JobSet":
        return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name}, "spec": {
            "suspend": False, "replicatedJobs": [
                {"name": "driver", "replicas": 1, "template": {"spec": {"template": template()}}},
                {"name": "workers", "replicas": 1, "template": {"spec": {"template": last}}}]}}
    if kind == "PyTorchJob":
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": {
            "runPolicy": {"suspend": False}, "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template()},
                "Worker": {"replicas": 1, "restartPolicy": "OnFailure", "template": last}}}}
    if kind in ("TFJob", "MPIJob"):  # issue 48 item 7: the Kubeflow kinds of PyTorchJob's shape
        first, second, key, version = (("Chief", "Worker", "tfReplicaSpecs", "v1") if kind == "TFJob"
                                       else ("Launcher", "Worker", "mpiReplicaSpecs", "v2beta1"))
        return {"apiVersion": f"kubeflow.org/{version}", "kind": kind, "metadata": {"name": name}, "spec": {
            "runPolicy": {"suspend": False}, key: {
                first: {"replicas": 1, "restartPolicy": "OnFailure", "template": template()},
                second: {"replicas": 1, "restartPolicy": "OnFailure", "template": last}}}}
    if kind == "StatefulSet":  # issue 48: held at replicas 0
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name}, "spec": {
            "replicas": 1, "serviceName": name, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": last["spec"]}}}
    if kind == "LeaderWorkerSet":  # issue 48: groups of a leader and workers; held at replicas 0
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": name},
                "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "leaderTemplate": template(),
                                                                 "workerTemplate": last}}}
    if kind == "Notebook":  # issue 48: one pod, its template a spec only; started (no kubeflow-resource-stopped)
        return {"apiVersion": "kubeflow.org/v1", "kind": "Notebook", "metadata": {"name": name}, "spec": {
            "template": {"spec": last["spec"]}}}
    assert kind == "RayJob"
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": name}, "spec": {
        "entrypoint": "python train.py", "suspend": False, "rayClusterSpec": {
            "headGroupSpec": {"rayStartParams": {}, "template": template()},
            "workerGroupSpecs": [
                {"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "rayStartParams": {},
                 "template": template()},
                {"groupName": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "rayStartParams": {},
                 "template": last}]}}}


# ----------------------------------------------------------------------------- gpuq's admission webhook
# The configurations as the chart renders them (deploy/helm/gpuq/templates/webhook.yaml; tests/deploy checks that
# they agree), pointed at a URL instead of the chart's Service.

# What is sent to gpuq (CEL matchConditions, docs/kubernetes.md "Admission webhook"): `t` is an object or one of its
# pod templates. The text is the chart's, character for character.
GPUQ_KEYS = ("(has(t.metadata) && ((has(t.metadata.labels) && t.metadata.labels.exists(k, k.startsWith('gpuq.io/')))"
             " || (has(t.metadata.annotations) && t.metadata.annotations.exists(k, k.startsWith('gpuq.io/')))))")
ASKS_FOR_GPUS = ("(has(t.spec) && ((has(t.spec.containers) ? t.spec.containers : []) + (has(t.spec.initContainers) ?"
                 " t.spec.initContainers : [])).exists(c, has(c.resources) && ((has(c.resources.limits) &&"
                 " c.resources.limits.exists(r, r.startsWith('nvidia.com/'))) || (has(c.resources.requests) &&"
                 " c.resources.requests.exists(r, r.startsWith('nvidia.com/'))))))")
# The object, and on an update the stored one too (a key or a GPU the update takes away still counts).
OBJECTS = "(request.operation == 'UPDATE' ? [object, oldObject] : [object])"
# Each kind's pod templates of object `x` (WorkloadKind.all_templates).
TEMPLATES = {
    "jobs": "(has(x.spec) && has(x.spec.template) ? [x.spec.template] : [])",
    "jobsets": ("(has(x.spec) && has(x.spec.replicatedJobs) ? x.spec.replicatedJobs.filter(j, has(j.template) &&"
                " has(j.template.spec) && has(j.template.spec.template)).map(j, j.template.spec.template) : [])"),
    "pytorchjobs": ("(has(x.spec) && has(x.spec.pytorchReplicaSpecs) ? x.spec.pytorchReplicaSpecs.filter(n,"
                    " has(x.spec.pytorchReplicaSpecs[n].template)).map(n, x.spec.pytorchReplicaSpecs[n].template)"
                    " : [])"),
    "tfjobs": ("(has(x.spec) && has(x.spec.tfReplicaSpecs) ? x.spec.tfReplicaSpecs.filter(n,"
               " has(x.spec.tfReplicaSpecs[n].template)).map(n, x.spec.tfReplicaSpecs[n].template) : [])"),
    "mpijobs": ("(has(x.spec) && has(x.spec.mpiReplicaSpecs) ? x.spec.mpiReplicaSpecs.filter(n,"
                " has(x.spec.mpiReplicaSpecs[n].template)).map(n, x.spec.mpiReplicaSpecs[n].template) : [])"),
    "notebooks": "(has(x.spec) && has(x.spec.template) ? [x.spec.template] : [])",
    "statefulsets": "(has(x.spec) && has(x.spec.template) ? [x.spec.template] : [])",
    "leaderworkersets": ("(has(x.spec) && has(x.spec.leaderWorkerTemplate) && has(x.spec.leaderWorkerTemplate"
                         ".leaderTemplate) ? [x.spec.leaderWorkerTemplate.leaderTemplate] : []) + (has(x.spec) &&"
                         " has(x.spec.leaderWorkerTemplate) && has(x.spec.leaderWorkerTemplate.workerTemplate) ?"
                         " [x.spec.leaderWorkerTemplate.workerTemplate] : [])"),
    "rayjobs": ("(has(x.spec) && has(x.spec.rayClusterSpec) && has(x.spec.rayClusterSpec.headGroupSpec) &&"
                " has(x.spec.rayClusterSpec.headGroupSpec.template) ? [x.spec.rayClusterSpec.headGroupSpec.template]"
                " : []) + (has(x.spec) && has(x.spec.rayClusterSpec) && has(x.spec.rayClusterSpec.workerGroupSpecs) ?"
                " x.spec.rayClusterSpec.workerGroupSpecs.filter(g, has(g.template)).map(g, g.template) : []) +"
                " (has(x.spec) && has(x.spec.submitterPodTemplate) ? [x.spec.submitterPodTemplate] : [])"),
}
WEBHOOK_KINDS = [  # (plural, group, version): one webhook each, so that each reads its own kind's templates
    ("jobs", "batch", "v1"), ("jobsets", "jobset.x-k8s.io", "v1alpha2"), ("pytorchjobs", "kubeflow.org", "v1"),
    ("tfjobs", "kubeflow.org", "v1"), ("mpijobs", "kubeflow.org", "v2beta1"), ("notebooks", "kubeflow.org", "v1"),
    ("leaderworkersets", "leaderworkerset.x-k8s.io", "v1"), ("statefulsets", "apps", "v1"), ("rayjobs", "ray.io", "v1")]


def workload_condition(plural: str) -> dict[str, str]:
    """A workload is sent when it, or any pod template of it, carries a gpuq.io/ label or annotation, or a template
    asks for an nvidia.com/ resource."""
    return {"name": "gpu-or-gpuq-keys", "expression": f"{OBJECTS}.exists(x, ([x] + {TEMPLATES[plural]}).exists(t, "
                                                      f"{GPUQ_KEYS} || {ASKS_FOR_GPUS}))"}


# A pod is sent for validation when it asks for an nvidia.com/ resource or carries a gpuq.io/ key (a plain pod's
# queue, gate and gpuq's keys), and for mutation when it is created labelled gpuq.io/queue (a plain pod to hold).
POD_CONDITION = {"name": "gpu-or-gpuq-keys", "expression": f"{OBJECTS}.exists(t, {ASKS_FOR_GPUS} || {GPUQ_KEYS})"}
POD_MUTATE_CONDITION = {"name": "queue-label", "expression": (
    "has(object.metadata) && has(object.metadata.labels) && 'gpuq.io/queue' in object.metadata.labels && "
    "!(has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, has(r.controller) "
    "&& r.controller == true))")}


def webhook_entry(name: str, url: str, path: str, namespaces: list[str], operations: list[str],
                  resources: list[dict[str, Any]], condition: dict[str, str],
                  failure_policy: str = "Fail") -> dict[str, Any]:
    return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": failure_policy,
            "timeoutSeconds": 5, "matchPolicy": "Equivalent",
            "clientConfig": {"url": url.rstrip("/") + path},
            "namespaceSelector": {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]},
            "objectSelector": {},
            "matchConditions": [condition],
            "rules": [{**r, "operations": operations, "scope": "Namespaced"} for r in resources]}


def webhook_configurations(name: str, url: str, namespaces: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(MutatingWebhookConfiguration, ValidatingWebhookConfiguration) named `name`, calling `url`."""
    def workloads(path: str, operations: list[str]) -> list[dict[str, Any]]:
        return [webhook_entry(f"{plural}.webhook.gpuq.io", url, path, namespaces, operations,
                              [{"apiGroups": [group], "apiVersions": [version], "resources": [plural]}],
                              workload_condition(plural))
                for plural, group, version in WEBHOOK_KINDS]

    pods = [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]
    mutating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [{**hook, "reinvocationPolicy": "Never"} for hook in [
                    *workloads("/mutate", ["CREATE"]),
                    webhook_entry("pods.webhook.gpuq.io", url, "/mutate", namespaces, ["CREATE"], pods,
                                  POD_MUTATE_CONDITION)]]}
    validating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                  "metadata": {"name": name}, "webhooks": [
                      *workloads("/validate", ["CREATE", "UPDATE"]),
                      webhook_entry("pods.webhook.gpuq.io", url, "/validate", namespaces, ["CREATE", "UPDATE"],
                                    pods, POD_CONDITION)]}
    return mutating, validating
