"""Event-submitted jobs sharing GPUs on the fake API server with real NATS and Postgres (issue 47): pods placed on a
time-sliced node ask one replica of nvidia.com/gpu and are labelled as not isolated (and the workload gets a
GpuNotIsolated Warning Event); pods placed on an MPS node that renames its replicas ask nvidia.com/gpu.shared and
carry the MPS client limits from their fraction and GPU memory; a MIG pod on a mixed node asks its profile."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import nats

from shared.config import parse_queues
from shared.domain import JobSpec, PodSet, PodTemplate
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack, workload_events

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
TOPO = {BLOCK: "b1", RACK: "r1"}


async def submit(nats_url: str, spec: JobSpec) -> None:
    nc = await nats.connect(nats_url)
    now = datetime.now(UTC)
    await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=now), source="pipeline",
                                                   time=now), JobSubmitted.scoped_subject(spec.team))
    await nc.close()


def shared_job(job_id: str, **pod_set: Any) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", kind="inference", pod_sets=(PodSet(
        name="infer", count=2, cpu_milli=500, memory_mib=512, template=PodTemplate(image="ghcr.io/example/serve:1"),
        **pod_set),))


async def job_pods(kube_api: Any, job_id: str) -> list[dict[str, Any]]:
    return [p for p in await kube_api.pods(NS, "gpuq.io/job")
            if (p["metadata"].get("annotations") or {}).get("gpuq.io/job-id") == job_id
            and not p["metadata"].get("deletionTimestamp")]


async def test_time_sliced_pods_ask_a_replica_and_say_they_are_not_isolated(fresh: tuple[str, str],
                                                                           kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("ts", gpus=1, gpu_product=H100, gpu_memory_mib=81559, sharing="time-slicing", replicas=4,
                           labels=TOPO)
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await submit(nats_url, shared_job("pipeline:ts-1", gpus_per_pod=1, gpu_fraction=0.25,
                                          gpu_sharing="time-slicing"))
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        pods = await job_pods(kube_api, "pipeline:ts-1")
        workload = pods[0]["metadata"]["labels"]["job-name"]
        events = await workload_events(client, NS, workload)
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {"ts"}
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["metadata"]["labels"]["gpuq.io/gpu-sharing"] == "time-slicing"
        assert pod["metadata"]["annotations"]["gpuq.io/gpu-isolation"].startswith("none")
    (warning,) = [e for e in events if e["reason"] == "GpuNotIsolated"]
    assert warning["type"] == "Warning" and "isolation none" in warning["message"]


async def test_mps_pods_ask_the_renamed_resource_with_their_limits(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("mps", gpus=1, gpu_product=H100, gpu_memory_mib=81559, sharing="mps", replicas=4,
                           renamed=True, labels=TOPO)
    await kube_api.create_namespace(NS)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await submit(nats_url, shared_job("pipeline:mps-1", gpus_per_pod=1, gpu_fraction=0.3, gpu_memory_mib=16384,
                                          gpu_sharing="mps"))
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        pods = await job_pods(kube_api, "pipeline:mps-1")
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {"mps"}
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu.shared"] == "1"
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
        assert pod["metadata"]["labels"]["gpuq.io/gpu-sharing"] == "mps"


async def test_a_mig_pod_on_a_mixed_node_asks_its_profile(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("mixed", gpus=1, gpu_product=H100, mig={"1g.10gb": 7, "3g.40gb": 2}, labels=TOPO)
    await kube_api.create_namespace(NS)
    quotas = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
        "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}]})
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, quotas, kube_cluster(), kube_api.kubeconfig):
        await submit(nats_url, shared_job("pipeline:mig-1", mig_profile="3g.40gb"))
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        pods = await job_pods(kube_api, "pipeline:mig-1")
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {"mixed"}
    for pod in pods:
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": "1"}
