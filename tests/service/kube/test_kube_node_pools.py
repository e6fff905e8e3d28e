"""Node pools as flavors on the fake API server with real NATS and Postgres (issue 48, items 4 and 5): a Job that
selects no node pool, in a queue whose `pools` are [a, b], is given pool b once pool a's quota is spent, placed on
pool b's node (nodes carry the pool in `kubernetes.pool_label`, here gpuq.io/pool) and runs there: the executor's
hostname binding is all the pod needs. A job submitted as an event gets its pods' templates from its spec: the pool
selector is written there as the nodes' `kubernetes.pool_label`, which they carry."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import nats
from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from shared.domain import JobSpec, PodSet, PodTemplate
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
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


async def test_an_event_submitted_job_selects_its_pool_by_the_nodes_pool_label(fresh: tuple[str, str],
                                                                               kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n-a", gpus=8, gpu_product=H100, labels={"gpuq.io/pool": "a"})
    fake.add_node("n-b", gpus=8, gpu_product=H100, labels={"gpuq.io/pool": "b"})
    await kube_api.create_namespace(NS)
    cluster = kube_cluster(pool_label="gpuq.io/pool")
    spec = JobSpec(job_id="pipeline:pooled-1", team="team-a", queue="team-a", pod_sets=(PodSet(
        name="w", count=1, gpus_per_pod=4, cpu_milli=1000, memory_mib=1024,
        template=PodTemplate(image="ghcr.io/example/train:1")),))
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await eventually("the NodeInventory", lambda: bus_events(nats_url, "node.inventory"))
        nc = await nats.connect(nats_url)
        now = datetime.now(UTC)
        await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=now), source="pipeline",
                                                       time=now), JobSubmitted.scoped_subject(spec.team))
        await nc.close()
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        pods = [p for p in await kube_api.pods(NS, "gpuq.io/job") if not p["metadata"].get("deletionTimestamp")]
    (pod,) = pods
    assert pod["spec"]["nodeName"] == "n-a"
    assert pod["spec"]["nodeSelector"]["gpuq.io/pool"] == "a" and "pool" not in pod["spec"]["nodeSelector"]
