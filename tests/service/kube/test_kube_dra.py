"""DRA on an API server serving resource.k8s.io/v1 (the fake) with real NATS and Postgres (issue 47 item 4): the
executor reads the ResourceSlices NVIDIA's DRA driver publishes as the nodes' GPUs, the scheduler places a gang
against those devices, and each pod gets its own ResourceClaim (made from the pod set's ResourceClaimTemplate)
allocated with the devices gpuq chose, before gpuq's scheduling gate is removed; kube-scheduler (the fake) binds
the pods where their claims are allocated and reserves the claims for them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import nats
from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from shared.config import parse_queues
from shared.domain import JobSpec, PodSet, PodTemplate
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from tests.kube_support import BLOCK, RACK, bus_events, eventually, kube_cluster, kube_stack

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})
CLAIM = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")
CLAIM_TEMPLATE = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaimTemplate",
                                            "resourceclaimtemplates")
SLICE = create_global_resource("resource.k8s.io", "v1", "ResourceSlice", "resourceslices")
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def valid(obj: dict[str, Any]) -> None:
    """Checked against Kubernetes 1.34's schema of resource.k8s.io/v1, strictly (no unknown field)."""
    kubernetes_validate.validate(obj, "1.34.0", strict=True)


async def test_a_gang_runs_on_dra_devices_with_claims_allocated_as_gpuq_placed_it(fresh: tuple[str, str],
                                                                                  kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for node in ("d1", "d2"):  # no nvidia.com/gpu advertised: the GPUs are the DRA driver's devices
        fake.add_node(node, labels={BLOCK: "b1", RACK: "r1"})
        fake.add_gpu_slice(node, gpus=4, product="NVIDIA H100 80GB HBM3", migs={"1g.10gb": 2})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    spec = JobSpec(job_id="pipeline:dra-1", team="team-a", queue="team-a", pod_sets=(PodSet(
        name="workers", count=2, gpus_per_pod=4, cpu_milli=1000, memory_mib=1024,
        template=PodTemplate(image="ghcr.io/example/train:1")),))
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        inventory = await eventually("the NodeInventory", lambda: bus_events(nats_url, "node.inventory"))
        nodes = {n["name"]: n for part in inventory for n in part["nodes"]}
        assert {k: (v["gpus"], v["gpu_model"]) for k, v in nodes.items()} == {"d1": (4, "H100-80GB"),
                                                                              "d2": (4, "H100-80GB")}
        nc = await nats.connect(nats_url)
        now = datetime.now(UTC)
        await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=spec, submitted_at=now), source="pipeline",
                                                       time=now), JobSubmitted.scoped_subject(spec.team))
        await nc.close()
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        (placed,) = await bus_events(nats_url, "job.placed")
        pods = [p for p in await kube_api.pods(NS, "gpuq.io/job") if not p["metadata"].get("deletionTimestamp")]
        claims = {c["metadata"]["name"]: c.to_dict() async for c in client.list(CLAIM, namespace=NS)}
        templates = [t.to_dict() async for t in client.list(CLAIM_TEMPLATE, namespace=NS)]
        slices = [s.to_dict() async for s in client.list(SLICE)]
    assert len(pods) == 2 and len(claims) == 2 and len(templates) == 1
    (template,) = templates
    assert template["spec"]["spec"]["devices"]["requests"] == [{"name": "gpus", "exactly": {
        "deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 4}}]
    by_binding = {b["node"]: b["gpu_indices"] for b in placed["bindings"]}
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in (container["resources"].get("limits") or {})
        assert container["resources"]["claims"] == [{"name": "gpus"}]
        assert pod["spec"]["resourceClaims"] == [{"name": "gpus",
                                                  "resourceClaimTemplateName": template["metadata"]["name"]}]
        (status,) = pod["status"]["resourceClaimStatuses"]
        claim = claims[status["resourceClaimName"]]
        node = pod["spec"]["nodeName"]
        allocation = claim["status"]["allocation"]
        # the devices of the pod's binding (whole GPU index i: the node's device gpu-i), on the pod's node
        assert allocation["devices"]["results"] == [
            {"request": "gpus", "driver": "gpu.nvidia.com", "pool": node, "device": f"gpu-{i}"}
            for i in by_binding[node]]
        assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"] == [
            {"key": "metadata.name", "operator": "In", "values": [node]}]
        assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": pod["metadata"]["name"],
                                                   "uid": pod["metadata"]["uid"]}]
        valid(claim)
    valid(template)
    for s in slices:
        valid(s)
