"""Spot interruption notices on the fake API server with real NATS and Postgres: when a node gets a termination
handler's taint (aws-node-termination-handler's spot-itn here; the test plays the handler), the jobs there that can
checkpoint are asked for one at once, and once the SDK answers (the test plays it too) are requeued from it and run
elsewhere, resuming from it; a job that cannot checkpoint is told and left running; a job that does not answer is
requeued from its last checkpoint when the wait is over."""

from __future__ import annotations

from typing import Any

from services.executor.kube.client import NODE, POD
from tests.kube_support import eventually, kube_cluster, kube_stack, workload_events
from tests.service.kube.test_kube_executor import JOB, QUEUES, _count, _merge, events_of, job, live_pods, setup

NS = "ml-team-a"
SPOT_ITN = {"key": "aws-node-termination-handler/spot-itn", "value": "spot-itn-1", "effect": "NoSchedule"}


async def _pod_of(kube_api: Any, prefix: str) -> dict[str, Any]:
    return next(p for p in await live_pods(kube_api) if p["metadata"]["name"].startswith(prefix))


async def test_a_spot_notice_checkpoints_the_jobs_there_and_requeues_them_from_it(fresh: tuple[str, str],
                                                                                  kube_api: Any) -> None:
    nats_url, _ = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, _, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("saver", gpus=4, annotations={"gpuq.io/checkpoint": "true"}))
        await client.create(job("plain", gpus=4))
        started = await eventually("both started", lambda: _count(events_of(nats_url, "started"), 2))
        (node,) = {n for e in started for n in e["nodes"]}  # binpacked onto one node
        other = "n2" if node == "n1" else "n1"
        # The termination handler taints the node: two minutes to go.
        await client.patch(NODE, node, {"spec": {"taints": [SPOT_ITN]}}, patch_type=_merge())

        async def asked() -> Any:
            pod = await _pod_of(kube_api, "saver")
            return pod["metadata"]["annotations"].get("gpuq.io/checkpoint-requested")

        await eventually("the checkpoint request on the saver's pod", asked)
        plain = await _pod_of(kube_api, "plain")
        assert "gpuq.io/checkpoint-requested" not in plain["metadata"]["annotations"]
        notices = {e["involvedObject"]["name"]: e["message"] for e in
                   [*await workload_events(client, NS, "saver"), *await workload_events(client, NS, "plain")]
                   if e["reason"] == "InterruptionNotice"}
        taint = "taint aws-node-termination-handler/spot-itn=spot-itn-1:NoSchedule"
        assert notices["saver"].startswith(f"node {node} is being reclaimed ({taint}): checkpoint requested before ")
        assert notices["plain"] == (f"node {node} is being reclaimed ({taint}); the job cannot checkpoint: it runs "
                                    "until the node goes")
        assert await events_of(nats_url, "preempted") == []  # it waits for the checkpoint
        saver = await _pod_of(kube_api, "saver")
        await client.patch(POD, saver["metadata"]["name"], {"metadata": {"annotations": {
            "gpuq.io/last-checkpoint": "s3://ckpt/saver/at-notice"}}}, namespace=NS, patch_type=_merge())
        (preempted,) = await eventually("the saver requeued", lambda: events_of(nats_url, "preempted"))
        assert preempted["reason"] == "NodeFailure" and preempted["checkpoint_uri"] == "s3://ckpt/saver/at-notice"

        async def moved() -> Any:
            pods = [p for p in await live_pods(kube_api) if p["metadata"]["name"].startswith("saver")
                    and not p["spec"].get("schedulingGates")
                    and p["metadata"]["annotations"].get("gpuq.io/binding", "").startswith("2/")]
            return pods or None

        (again,) = await eventually("the requeued job on the other node", moved)
        assert again["spec"]["nodeSelector"]["kubernetes.io/hostname"] == other  # the tainted node takes nothing
        assert again["metadata"]["annotations"]["gpuq.io/resume-from"] == "s3://ckpt/saver/at-notice"
        assert [e["job_id"] for e in await events_of(nats_url, "preempted")] == [preempted["job_id"]]
        assert await events_of(nats_url, "failed") == []  # the plain job still runs


async def test_a_job_that_does_not_answer_the_notice_is_requeued_when_the_wait_is_over(fresh: tuple[str, str],
                                                                                       kube_api: Any) -> None:
    nats_url, _ = fresh
    client = await setup(kube_api)
    cluster = kube_cluster(interruption_checkpoint_s=1)
    async with kube_api.autopilot(), kube_stack(nats_url, _, QUEUES, cluster, kube_api.kubeconfig):
        await client.create(job("silent", gpus=8, annotations={"gpuq.io/checkpoint": "true"}))
        (started,) = await eventually("started", lambda: events_of(nats_url, "started"))
        await client.patch(NODE, started["nodes"][0], {"spec": {"taints": [SPOT_ITN]}}, patch_type=_merge())
        (preempted,) = await eventually("requeued without a checkpoint", lambda: events_of(nats_url, "preempted"))
        assert preempted["reason"] == "NodeFailure" and preempted["checkpoint_uri"] is None
        requeued = [e["message"] for e in await workload_events(client, NS, "silent") if e["reason"] == "Requeued"
                    and e["message"].startswith("NodeFailure")]
        assert requeued == [f"NodeFailure: node {started['nodes'][0]} is being reclaimed (taint "
                            "aws-node-termination-handler/spot-itn=spot-itn-1:NoSchedule): no checkpoint within 1 s "
                            "of the notice: requeued from the start"]


async def test_the_spot_flavor_takes_only_preemptible_jobs_of_queues_that_allow_it(fresh: tuple[str, str],
                                                                                   kube_api: Any) -> None:
    from shared.config import parse_queues

    nats_url, _ = fresh
    kube_api.fake.add_node("a-spot", gpus=8, gpu_product="NVIDIA-H100-80GB-HBM3",
                           labels={"karpenter.sh/capacity-type": "spot"})
    client = await setup(kube_api, nodes=("b-ondemand",))  # "a-spot" sorts first: where a binpacker looks first
    queues = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}, {"name": "prod", "value": 500, "preemptible": False}],
        "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}},
                    "spot_for_preemptible": True}],
        "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
    })
    cluster = kube_cluster(spot_selector={"karpenter.sh/capacity-type": "spot"})
    async with kube_api.autopilot(), kube_stack(nats_url, _, queues, cluster, kube_api.kubeconfig):
        for name in ("prod-1", "prod-2"):
            prod = job(name, gpus=8).to_dict()
            prod["metadata"]["labels"]["gpuq.io/priority-class"] = "prod"
            await client.create(JOB(prod))
            await eventually(f"{name} queued", lambda name=name: _said(client, name, ("Pending", "Admitted")))

        async def one_waits() -> Any:
            said = [*await _said(client, "prod-1", ("Pending",)), *await _said(client, "prod-2", ("Pending",))]
            # 0 free of 8: the spot node's 8 are not counted for it
            return said if any(e["message"].startswith("InsufficientGpus: needs 8×H100-80GB; 0 free of 8;")
                               for e in said) else None

        await eventually("the second prod job waiting: the spot node is not for it", one_waits)
        (started,) = await events_of(nats_url, "started")
        assert started["nodes"] == ["b-ondemand"]  # never on spot
        await client.create(job("batch", gpus=8))  # preemptible ("normal"): it may use the spot node
        both = await eventually("batch started", lambda: _count(events_of(nats_url, "started"), 2))
        assert [e["nodes"] for e in both] == [["b-ondemand"], ["a-spot"]]


async def _said(client: Any, name: str, reasons: tuple[str, ...]) -> list[dict[str, Any]]:
    return [e for e in await workload_events(client, NS, name) if e["reason"] in reasons]
