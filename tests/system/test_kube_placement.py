"""Done means, placement: a suspended PyTorchJob of 2 workers × 8 GPUs in team-a's namespace waits with its pending
reason on a Kubernetes Event, is admitted and placed in one rack (the rack from node labels), its pods are ungated
onto exactly those nodes, the kubelet runs them, JobStarted is sent, the job completes and a metering row appears.
Real NATS, real Postgres, the fake API server (or GPUQ_KUBECONFIG's cluster) through lightkube."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from tests.kube_support import (
    BLOCK,
    H100,
    RACK,
    bus_events,
    eventually,
    fetchval,
    kube_cluster,
    kube_stack,
    set_node,
    workload_events,
)

QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]}],
})
PYTORCHJOB = create_namespaced_resource("kubeflow.org", "v1", "PyTorchJob", "pytorchjobs")


def pytorchjob() -> dict[str, Any]:
    container = {"name": "pytorch", "image": "ghcr.io/example/bert:2.0", "command": ["torchrun", "train.py"],
                 "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"cpu": "16", "memory": "64Gi"}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": "bert", "namespace": "ml-team-a", "labels": {"gpuq.io/queue": "team-a"},
                         "annotations": {"gpuq.io/topology-required": "rack"}},
            "spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": {"Worker": {
                "replicas": 2, "restartPolicy": "Never",
                "template": {"spec": {"containers": [container]}}}}}}


async def test_pytorchjob_is_placed_in_one_rack_runs_and_is_metered(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    # Rack r1 holds 8 + 4 GPUs (no room for two 8-GPU pods); rack r2 has two 8-GPU nodes, one of them cordoned.
    for name, gpus, rack, cordoned in (("n1", 8, "r1", False), ("n2", 4, "r1", False), ("n3", 8, "r2", True),
                                       ("n4", 8, "r2", False)):
        fake.add_node(name, gpus=gpus, gpu_product=H100, gpu_memory_mib=81559, labels={BLOCK: "b1", RACK: rack},
                      unschedulable=cordoned)
    await kube_api.create_namespace("ml-team-a")
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "metering", "executor")):
        await client.create(PYTORCHJOB(pytorchjob()))

        async def pending_event() -> Any:
            return [e for e in await workload_events(client, "ml-team-a", "bert") if e.get("reason") == "Pending"]

        (event, *_) = await eventually("a Pending event on the PyTorchJob", pending_event)
        assert "rack" in event["message"], event["message"]  # why it waits: no rack has room while n3 is cordoned

        # n3 comes back (the node informer announces it): the gang fits in rack r2 only.
        await set_node(client, "n3", {"spec": {"unschedulable": None}})

        async def ungated() -> Any:
            pods = await kube_api.pods("ml-team-a")
            mine = [p for p in pods if p["metadata"].get("labels", {}).get("gpuq.io/job")]
            if len(mine) == 2 and all(not p["spec"].get("schedulingGates") for p in mine):
                return mine
            return None

        pods = await eventually("both worker pods ungated", ungated)
        assert sorted(p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods) == ["n3", "n4"]
        await kube_api.run_pods_to_ready("ml-team-a", "gpuq.io/job", count=2)
        started = await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        assert sorted(started[0]["nodes"]) == ["n3", "n4"]
        await kube_api.complete_pods("ml-team-a", "gpuq.io/job")
        job_id = started[0]["job_id"]
        await eventually("JobCompleted", lambda: bus_events(nats_url, "job.completed"))
        await eventually("a metering row", lambda: fetchval(
            database_url, "SELECT count(*) FROM metering.allocations WHERE job_id = $1 AND ended_at IS NOT NULL",
            job_id))
        reasons = {e.get("reason") for e in await workload_events(client, "ml-team-a", "bert")}
        workload = await client.get(PYTORCHJOB, "bert", namespace="ml-team-a")
    assert {"Submitted", "Pending", "Admitted", "Placed", "Completed"} <= reasons
    assert workload["metadata"]["annotations"]["gpuq.io/status"] == "Completed"
