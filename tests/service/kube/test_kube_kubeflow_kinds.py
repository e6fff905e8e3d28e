"""An MPIJob (kubeflow.org/v2beta1) through the Kubernetes executor, issue 48 item 7: taken in suspended, admitted,
its templates written with gpuq's placement (and scheduling gate), resumed through runPolicy.suspend; the fake
mpi-operator creates the launcher and worker pods from the resumed templates, which gpuq ungates on the nodes it
chose; it writes Succeeded once the launcher succeeds, and gpuq reports the job completed."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
MPIJOB = create_namespaced_resource("kubeflow.org", "v2beta1", "MPIJob", "mpijobs")
GATE = "gpuq.io/placement"


def _pod_spec(gpus: int, name: str) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": str(gpus)} if gpus else {}
    return {"restartPolicy": "Never", "containers": [{"name": name, "image": "ghcr.io/example/mpi:1", "resources": {
        "limits": limits, "requests": {"cpu": "2", "memory": "4Gi"}}}]}


async def events_of(nats_url: str, fact: str) -> list[dict[str, Any]]:
    return await bus_events(nats_url, f"job.{fact}")


async def test_mpijob_is_held_admitted_and_started_where_placed(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    for name in ("n1", "n2"):
        kube_api.fake.add_node(name, gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    body: dict[str, Any] = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
            "metadata": {"name": "allreduce", "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
            "spec": {"slotsPerWorker": 8, "runPolicy": {"suspend": True}, "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": _pod_spec(0, "launcher")}},
                "Worker": {"replicas": 2, "template": {"spec": _pod_spec(8, "worker")}}}}}
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(MPIJOB(body))

        async def resumed() -> dict[str, Any] | None:
            obj = (await client.get(MPIJOB, "allreduce", namespace=NS)).to_dict()
            return obj if obj["spec"]["runPolicy"].get("suspend") is False else None

        job = await eventually("MPIJob resumed by gpuq", resumed)
        (admitted,) = await events_of(nats_url, "admitted")
        replicas = job["spec"]["mpiReplicaSpecs"]
        for rtype in ("Launcher", "Worker"):  # each replica type's template carries gpuq's labels and gate
            tpl = replicas[rtype]["template"]
            assert tpl["metadata"]["labels"]["gpuq.io/pod-set"] == rtype.lower()
            assert [g["name"] for g in tpl["spec"]["schedulingGates"]] == [GATE]
        # The fake mpi-operator creates the launcher and worker pods from the templates as resumed: gated until gpuq
        # gives each its node.
        ready = await kube_api.run_pods_to_ready(NS, "gpuq.io/job", count=3)
        assert all(not p["spec"].get("schedulingGates") for p in ready)
        workers = sorted(p["spec"]["nodeName"] for p in ready
                         if p["metadata"]["labels"]["gpuq.io/pod-set"] == "worker")
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        assert workers == ["n1", "n2"] and sorted(started["nodes"]) == ["n1", "n2"]
        assert started["job_id"] == admitted["job_id"]
        await kube_api.complete_pods(NS, "gpuq.io/job")  # the launcher succeeded: the operator writes Succeeded
        (done,) = await eventually("JobCompleted", lambda: events_of(nats_url, "completed"))
    assert done["job_id"] == started["job_id"]
