"""Node pools as flavors on the fake API server with real NATS and Postgres (issue 48, items 4 and 5): a Job that
selects no node pool, in a queue whose `pools` are [a, b], is given pool b once pool a's quota is spent, placed on
pool b's node (nodes carry the pool in `kubernetes.pool_label`, here gpuq.io/pool) and runs there: the executor's
hostname binding is all the pod needs, no `pool` nodeSelector the nodes do not carry is written."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from tests.kube_support import H100, bus_events, eventually, kube_cluster, kube_stack

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "pools": ["a", "b"],
                "quotas": {"H100-80GB": {"nominal": 16}, "pool/a": {"nominal": 4}, "pool/b": {"nominal": 8}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def job(name: str, gpus: int) -> Any:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "4", "memory": "8Gi"}}}
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                         "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never",
                                                                  "containers": [container]}}}})


async def event_of(nats_url: str, kind: str, name: str) -> dict[str, Any] | None:
    for e in await bus_events(nats_url, kind):
        if e["job_id"].startswith(f"{NS}.{name}."):
            return e
    return None


async def started(nats_url: str, name: str) -> bool:
    return await event_of(nats_url, "job.started", name) is not None


async def test_admission_chooses_the_pool_and_the_job_runs_on_its_node(fresh: tuple[str, str],
                                                                       kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n-a", gpus=8, gpu_product=H100, labels={"gpuq.io/pool": "a"})
    fake.add_node("n-b", gpus=8, gpu_product=H100, labels={"gpuq.io/pool": "b"})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    cluster = kube_cluster(pool_label="gpuq.io/pool")
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("first", 4))
        await eventually("first started", lambda: started(nats_url, "first"))
        await client.create(job("second", 4))  # binpack alone would put it on n-a's free half
        await eventually("second started", lambda: started(nats_url, "second"))
        admitted = await event_of(nats_url, "job.admitted", "second")
        placed = {n: await event_of(nats_url, "job.placed", n) for n in ("first", "second")}
    assert admitted is not None and admitted["quota"] == {"H100-80GB": 4, "pool/b": 4}
    assert {n: sorted({b["node"] for b in e["bindings"]}) for n, e in placed.items() if e} == {
        "first": ["n-a"], "second": ["n-b"]}
