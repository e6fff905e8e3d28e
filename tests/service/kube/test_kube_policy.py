"""Issue 44 item 2, the kubectl policy bypass, replayed at the intake with no admission webhook installed (a cluster
without it, or a workload created while it was down): a suspended Job created with kubectl that runs
`docker.io/evil/miner` with an inline `AWS_SECRET_ACCESS_KEY` and a claim outside the dataset allow-list was
submitted to gpuq and run, because the intake copied none of it into what the policy checks. It is refused with a
Warning Event and the workload's `gpuq.io/status` naming the rule, and never reaches the bus; a Job within the
policy is taken as before. Real NATS and Postgres; the fake API server or GPUQ_KUBECONFIG's cluster."""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_namespaced_resource

from shared.config import parse_queues
from tests.kube_support import bus_events, eventually, kube_cluster, kube_stack, workload_events

NS = "ml-policy"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
    "governance": {"default": {"allowed_images": ["ghcr.io/example"], "allowed_datasets": ["datasets/*"]}},
})
JOB = create_namespaced_resource("batch", "v1", "Job", "jobs")


def job(name: str, *, image: str, env: list[dict[str, Any]], claim: str) -> Any:
    container = {"name": "main", "image": image, "command": ["sleep", "30"], "env": env,
                 "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "100m", "memory": "64Mi"}}}
    return JOB({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": name, "namespace": NS, "labels": {"gpuq.io/queue": "team-a"}},
                "spec": {"suspend": True, "backoffLimit": 0, "template": {"spec": {
                    "restartPolicy": "Never", "containers": [container],
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}}}})


async def test_the_kubectl_policy_bypass_is_refused_at_intake_without_the_webhook(fresh: tuple[str, str],
                                                                                  kube_api: Any) -> None:
    nats_url, database_url = fresh
    await kube_api.ensure_worker_node()
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    async with kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("miner", image="docker.io/evil/miner", claim="team-b-private",
                                env=[{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG"}]))
        await client.create(job("fine", image="ghcr.io/example/train:1", claim="datasets/imagenet",
                                env=[{"name": "AWS_SECRET_ACCESS_KEY",
                                      "valueFrom": {"secretKeyRef": {"name": "aws", "key": "secret"}}}]))

        async def refused() -> Any:
            return [e for e in await workload_events(client, NS, "miner") if e["type"] == "Warning"]

        (event,) = await eventually("the miner's refusal", refused)

        async def submitted() -> Any:
            return await bus_events(nats_url, "job.submitted.*")

        (accepted,) = await eventually("the compliant job's submission", submitted)
    assert event["reason"] == "PolicyViolation"
    assert "docker.io/evil/miner" in event["message"] and "(rule: allowed_images)" in event["message"]
    status = (await client.get(JOB, "miner", namespace=NS))["metadata"]["annotations"]["gpuq.io/status"]
    assert status.startswith("Refused: PolicyViolation") and "allowed_images" in status
    assert accepted["spec"]["workload"]["name"] == "fine"  # the miner never reached the bus
