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


# ----------------------------------------------------------------------------- gpuq's admission webhook
# The configurations as the chart renders them (deploy/helm/gpuq/templates/webhook.yaml; tests/deploy checks that
# they agree), pointed at a URL instead of the chart's Service.

WEBHOOK_RESOURCES = [
    {"apiGroups": ["batch"], "apiVersions": ["v1"], "resources": ["jobs"]},
    {"apiGroups": ["jobset.x-k8s.io"], "apiVersions": ["v1alpha2"], "resources": ["jobsets"]},
    {"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"], "resources": ["pytorchjobs"]},
    {"apiGroups": ["ray.io"], "apiVersions": ["v1"], "resources": ["rayjobs"]},
]


def webhook_entry(name: str, url: str, path: str, namespaces: list[str], operations: list[str],
                  resources: list[dict[str, Any]], failure_policy: str = "Fail") -> dict[str, Any]:
    return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": failure_policy,
            "timeoutSeconds": 5, "matchPolicy": "Equivalent",
            "clientConfig": {"url": url.rstrip("/") + path},
            "namespaceSelector": {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(namespaces)}]},
            "objectSelector": {},
            "rules": [{**r, "operations": operations, "scope": "Namespaced"} for r in resources]}


def webhook_configurations(name: str, url: str, namespaces: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(MutatingWebhookConfiguration, ValidatingWebhookConfiguration) named `name`, calling `url`."""
    pods = [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}]
    mutating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": name}, "webhooks": [
                    {**webhook_entry("workloads.webhook.gpuq.io", url, "/mutate", namespaces, ["CREATE"],
                                     WEBHOOK_RESOURCES), "reinvocationPolicy": "Never"}]}
    validating = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
                  "metadata": {"name": name}, "webhooks": [
                      webhook_entry("workloads.webhook.gpuq.io", url, "/validate", namespaces, ["CREATE", "UPDATE"],
                                    WEBHOOK_RESOURCES),
                      webhook_entry("pods.webhook.gpuq.io", url, "/validate", namespaces, ["CREATE", "UPDATE"],
                                    pods)]}
    return mutating, validating
