"""What a workload asks of its nodes, honoured by gpuq's placement on an API server (the fake) with real NATS and
Postgres: a Job's nodeSelector and required node affinity send it to the nodes they match (binpack alone would
choose another), and a Job no node matches waits with a Pending Event naming its selector."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from tests.kube_support import H100, bus_events, eventually, kube_cluster, kube_stack, workload_events

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 64}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def job(name: str, *, gpus: int = 8, pods: int = 1, pod_spec: dict[str, Any] | None = None) -> Any:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"cpu": "4", "memory": "8Gi"}}}
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "completionMode": "Indexed", "completions": pods, "parallelism": pods,
                         "backoffLimit": 0, "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                                                                  **(pod_spec or {})}}}})


async def placed_nodes(nats_url: str, job_id_prefix: str) -> list[str] | None:
    for e in await bus_events(nats_url, "job.placed"):
        if e["job_id"].startswith(job_id_prefix):
            return sorted({b["node"] for b in e["bindings"]})
    return None


async def test_node_selector_and_affinity_are_honoured_and_a_mismatch_is_explained(fresh: tuple[str, str],
                                                                                   kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n1", gpus=8, gpu_product=H100, labels={"pool": "spot", "zone": "z1"})
    fake.add_node("n2", gpus=8, gpu_product=H100, labels={"pool": "spot", "zone": "z2"})
    fake.add_node("n3", gpus=8, gpu_product=H100, labels={"pool": "reserved", "zone": "z2"})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    zone_z2 = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z2"]},
                              {"key": "pool", "operator": "NotIn", "values": ["reserved"]}]}]}}}
    nowhere = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z9"]}]}]}}}
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        # Binpack alone would put each of them on n1 (the first node by rank).
        await client.create(job("reserved", gpus=4, pod_spec={"nodeSelector": {"pool": "reserved"}}))
        assert await eventually("placed", lambda: placed_nodes(nats_url, f"{NS}.reserved.")) == ["n3"]
        await client.create(job("zoned", gpus=4, pod_spec={"affinity": zone_z2}))
        assert await eventually("placed", lambda: placed_nodes(nats_url, f"{NS}.zoned.")) == ["n2"]
        await client.create(job("lost", gpus=4, pod_spec={"affinity": nowhere}))

        async def pending() -> Any:
            return [e for e in await workload_events(client, NS, "lost") if e["reason"] == "Pending"]

        (event,) = await eventually("the Pending Event", pending)
        # The pods ran where placed: kube-scheduler, enforcing the same terms, bound them there.
        await eventually("both started", lambda: _started(nats_url, 2))
    assert event["message"].startswith("NoMatchingNode: pod set main asks node affinity zone In [z9]: none of the "
                                       "3 node(s) with H100-80GB it may use matches; their labels: zone=z1, zone=z2")
    assert await placed_nodes(nats_url, f"{NS}.lost.") is None


async def _started(nats_url: str, count: int) -> Any:
    started = await bus_events(nats_url, "job.started")
    return started if len(started) >= count else None
