"""gpuq beside workloads it does not manage, on an API server (the fake) with real NATS and Postgres: every pod bound
to a GPU node counts, whoever runs it (an inference Deployment's pod, another scheduler's, a DaemonSet's), so gpuq
never places onto the GPUs they hold, and says so.

The fake runs no Deployment, ReplicaSet or DaemonSet controller: the tests create the pods those controllers (and
another scheduler) would, with their owner references."""

from __future__ import annotations

from typing import Any

import asyncpg
import httpx

from cli.jobs import held_lines
from services.api import tokens
from services.executor.kube.client import POD
from services.scheduler import readmodel
from services.stack import Stack, StackSettings
from shared.config import parse_queues
from shared.servers import free_port
from tests.kube_support import H100, bus_events, eventually, kube_cluster, kube_stack, workload_events
from tests.service.kube.test_kube_placement_rules import job

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 64}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})


def foreign_pod(name: str, namespace: str, *, owner: str, gpus: int = 0, cpu: str = "1", memory: str = "1Gi",
                node: str | None = None, node_selector: dict[str, str] | None = None,
                scheduler: str | None = None) -> Any:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "ghcr.io/example/serve:1", "resources": {
        "limits": limits, "requests": {"cpu": cpu, "memory": memory, **limits}}}]}
    if node is not None:
        spec["nodeName"] = node  # bound by whoever created it (another scheduler, the DaemonSet controller)
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    kind, _, owner_name = owner.partition("/")
    return POD({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": namespace, "labels": {"app": owner_name},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": kind, "name": owner_name, "uid": f"uid-{owner_name}",
                             "controller": True}]}, "spec": spec})


async def held_on(nats_url: str, node: str) -> dict[str, Any] | None:
    """The last NodeChanged of `node`'s held resources, or the inventory's."""
    changed = [e["node"] for e in await bus_events(nats_url, "node.changed") if e["node"]["name"] == node]
    if changed:
        return dict(changed[-1]["held"])
    for inv in await bus_events(nats_url, "node.inventory"):
        for n in inv["nodes"]:
            if n["name"] == node:
                return dict(n["held"])
    return None


async def test_gpuq_never_places_onto_gpus_held_by_pods_it_does_not_manage(fresh: tuple[str, str],
                                                                           kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for name in ("n1", "n2", "n3"):
        fake.add_node(name, gpus=8, gpu_product=H100)
    for ns in (NS, "inference", "monitoring"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    # Before gpuq starts: an inference Deployment's pod holds all of n1's GPUs (kube-scheduler bound it), and a
    # DaemonSet's pod on every node holds CPU and memory.
    await client.create(foreign_pod("llm-7d9f-abcde", "inference", owner="ReplicaSet/llm-7d9f", gpus=8,
                                    node_selector={"kubernetes.io/hostname": "n1"}))
    for name in ("n1", "n2", "n3"):
        await client.create(foreign_pod(f"node-exporter-{name}", "monitoring", owner="DaemonSet/node-exporter",
                                        cpu="500m", memory="512Mi", node=name))
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        held = await eventually("n1 announced held", lambda: held_on(nats_url, "n1"))
        assert held == {"gpus": 8, "mig_slices": 0, "cpu_milli": 1500, "memory_mib": 1536, "pods": 2}
        # After it started: another scheduler's pod takes 4 GPUs of n2.
        await client.create(foreign_pod("batch-x", "inference", owner="ReplicaSet/batch", gpus=4, node="n2",
                                        scheduler="other-scheduler"))
        assert (await eventually("n2 held", lambda: _gpus_held(nats_url, "n2", 4)))["pods"] == 2
        # `gpuq queues` says so, from the scheduler's node facts.
        assert await eventually("gpuq queues", lambda: _held_lines(database_url)) == [
            "held outside gpuq: 12 GPU(s) on 2 node(s) (n1 8×H100-80GB, n2 4×H100-80GB)"]

        # A 2×8-GPU gang fits only if it uses the GPUs those pods hold: it waits, saying why.
        await client.create(job("gang", pods=2))

        async def pending() -> Any:
            return [e for e in await workload_events(client, NS, "gang") if e["reason"] == "Pending"]

        (event,) = await eventually("the Pending Event", pending)
        assert event["message"].startswith("InsufficientGpus: needs 16×H100-80GB; 12 free of 24 (12 held by pods gpuq "
                                           "does not manage)")
        assert await bus_events(nats_url, "job.placed") == []

        # The inference pod goes: n1 is gpuq's again, and the gang runs on n1 and n3, never on n2's held GPUs.
        await client.delete(POD, "llm-7d9f-abcde", namespace="inference")
        (placed,) = await eventually("placed", lambda: bus_events(nats_url, "job.placed"))
        assert sorted({b["node"] for b in placed["bindings"]}) == ["n1", "n3"]
        (started,) = await eventually("started", lambda: bus_events(nats_url, "job.started"))
    assert sorted(started["nodes"]) == ["n1", "n3"]  # kube-scheduler bound the pods where gpuq placed them


async def _gpus_held(nats_url: str, node: str, gpus: int) -> dict[str, Any] | None:
    held = await held_on(nats_url, node)
    return held if held is not None and held["gpus"] == gpus else None


async def test_the_api_gives_the_held_line_gpuq_queues_prints(fresh: tuple[str, str], kube_api: Any) -> None:
    """GET /v1/queues/held: what pods gpuq does not manage hold, per node and in all, with the very line `gpuq queues`
    prints from the database (the CLI prints the API's when it talks to one), to any team's token."""
    nats_url, database_url = fresh
    for name in ("n1", "n2"):
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100)
    for ns in (NS, "inference"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    await client.create(foreign_pod("llm-0", "inference", owner="ReplicaSet/llm", gpus=3, node="n2"))
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=kube_cluster(),
                             services=("admission", "scheduler", "executor", "api"), executor="kube",
                             kubeconfig=kube_api.kubeconfig, api_port=port)
    async with kube_api.autopilot(), Stack(settings), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        conn = await asyncpg.connect(database_url)
        try:
            token = (await tokens.issue(conn, "alice", team="team-a")).token
        finally:
            await conn.close()

        async def answered() -> dict[str, Any] | None:
            try:
                r = await http.get("/v1/queues/held", headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 and r.json()["gpus"] == 3 else None

        body = await eventually("the API's held GPUs", answered)
        lines = await eventually("gpuq queues", lambda: _held_lines(database_url, "3 GPU(s)"))
    assert body == {"gpus": 3, "mig_slices": 0, "line": "held outside gpuq: 3 GPU(s) on 1 node(s) (n2 3×H100-80GB)",
                    "nodes": [{"node": "n2", "gpu_model": "H100-80GB", "gpus": 3, "mig_slices": 0, "pods": 1}]}
    assert lines == [body["line"]]


async def _held_lines(database_url: str, what: str = "12 GPU(s)") -> list[str] | None:
    conn = await asyncpg.connect(database_url)
    try:
        lines = held_lines(await readmodel.nodes(conn))
    finally:
        await conn.close()
    return lines if lines and what in lines[0] else None
