"""A placement the cluster refuses is learnt from, on an API server (the fake) with real NATS and Postgres: a pod the
kubelet rejects (OutOfnvidia.com/gpu: its device plugin has fewer healthy GPUs than the node's allocatable says)
makes its node refuse that pod shape, the job is requeued as a placement failure with the kubelet's words, and the
second attempt runs elsewhere; the node is tried again once what runs there changes. (The pod that cannot bind,
kube-scheduler's refusal, is test_kube_executor's test_pod_that_cannot_bind_where_placed_is_placed_elsewhere_next.)"""

from __future__ import annotations

from typing import Any

from shared.config import parse_queues
from tests.kube_support import H100, bus_events, eventually, kube_cluster, kube_stack, workload_events
from tests.service.kube.test_kube_coexistence import foreign_pod
from tests.service.kube.test_kube_placement_rules import JOB

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 64}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
GPU_SHORT = ("OutOfnvidia.com/gpu", "Node didn't have enough resource: nvidia.com/gpu, requested: 8, used: 0, "
                                    "capacity: 6")


def job(name: str) -> Any:
    container = {"name": "trainer", "image": "ghcr.io/example/train:1",
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "4", "memory": "8Gi"}}}
    # backoffLimit 1: a kubelet-rejected pod is a failed pod to the Job controller; with 0 Kubernetes would fail the
    # Job itself before gpuq could place it again (docs/kubernetes.md, "Not done")
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "completionMode": "Indexed", "completions": 1, "parallelism": 1,
                         "backoffLimit": 1, "template": {"spec": {"restartPolicy": "Never",
                                                                  "containers": [container]}}}})


async def events_of(nats_url: str, fact: str) -> list[dict[str, Any]]:
    return await bus_events(nats_url, f"job.{fact}")


async def test_a_pod_the_kubelet_rejects_leads_to_a_second_attempt_elsewhere(fresh: tuple[str, str],
                                                                              kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for name in ("n1", "n2"):
        fake.add_node(name, gpus=8, gpu_product=H100)
    fake.kubelet.rejections["n1"] = GPU_SHORT
    await kube_api.create_namespace(NS)
    await kube_api.create_namespace("monitoring")
    client = kube_api.client()
    cluster = kube_cluster(requeue_backoff_s=600, requeue_limit=0)  # neither counted nor backed off
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("first"))
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        placed = await events_of(nats_url, "placed")
        assert [[b["node"] for b in p["bindings"]] for p in placed] == [["n1"], ["n2"]]
        assert started["nodes"] == ["n2"] and await events_of(nats_url, "failed") == []
        (preempted,) = await events_of(nats_url, "preempted")
        assert preempted["reason"] == "PlacementFailed"
        requeued = [e["message"] for e in await workload_events(client, NS, "first") if e["reason"] == "Requeued"
                    and e["message"].startswith("PlacementFailed")]
        (message,) = requeued
        assert message.startswith("PlacementFailed: pod first-0-") and message.endswith(
            f" was rejected by the kubelet of n1: OutOfnvidia.com/gpu: Pod was rejected: {GPU_SHORT[1]}; n1 gets no "
            "such pod until what runs there changes")
        (changed,) = [e for e in await bus_events(nats_url, "node.changed") if e.get("reason") == "PlacementRefused"]
        assert changed["node"]["name"] == "n1" and changed["message"].startswith("OutOfnvidia.com/gpu: Pod was")

        # While n1's usage is unchanged, a second job of that shape does not go there: it waits, saying why.
        await client.create(job("second"))

        async def pending() -> Any:
            return [e for e in await workload_events(client, NS, "second") if e["reason"] == "Pending"]

        (event,) = await eventually("the Pending Event", pending)
        assert event["message"].startswith(
            "PlacementRefused: needs 8×H100-80GB; 0 free of 8 on the 1 ready node(s) that did not refuse it; n1 "
            "refused a pod of 8 GPU(s), 4000m CPU, 8192 MiB (OutOfnvidia.com/gpu: Pod was rejected: Node didn't")
        # The node's usage changes (the device plugin fixed, a DaemonSet's pod arrives): n1 is tried again.
        del fake.kubelet.rejections["n1"]
        await client.create(foreign_pod("agent-n1", "monitoring", owner="DaemonSet/agent", node="n1"))
        await eventually("the second job started on n1", lambda: _started_on(nats_url, "n1"))


async def _started_on(nats_url: str, node: str) -> Any:
    return [e for e in await events_of(nats_url, "started") if e["nodes"] == [node]] or None

