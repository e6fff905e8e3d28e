"""Capacity that does not exist yet, on the fake API server with real NATS and Postgres: a queue that opts in asks
the cluster-autoscaler (the fake one, tests/kube/kubefake/autoscaler.py, which the test plays) with a
ProvisioningRequest for the job at its head that waits for nodes; the job runs on the nodes it adds, its pods
consume the request, the request goes once the job runs, and an idle node is released for scale-down after the
cool-down. A request the autoscaler fails is said (Event, `gpuq explain`) and gpuq stops waiting for it; a queue
that did not opt in never asks."""

from __future__ import annotations

from typing import Any

from services.api.readmodel import explain_lines, fetch_status
from services.core.kube import provisioning as prov
from shared.config import parse_queues
from tests.kube.kubefake.autoscaler import FakeAutoscaler
from tests.kube.kubefake.resources import NODES, POD_TEMPLATES, PODS, PROVISIONING_REQUESTS
from tests.kube_support import H100, eventually, kube_cluster, kube_stack, workload_events
from tests.service.kube.test_kube_placement_rules import job

NS = "ml-team-a"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"


def queues(provisioning: dict[str, Any] | None) -> Any:
    return parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 64}},
                    **({"provisioning": provisioning} if provisioning is not None else {})}],
        "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
    })


async def explain(database_url: str, job_id: str) -> list[str]:
    rows = await fetch_status(database_url, job_id)
    return explain_lines(rows[0], 0.0) if rows else []


async def job_id_of(database_url: str, name: str) -> str | None:
    rows = await fetch_status(database_url, None)
    return next((r["job_id"] for r in rows if r["job_id"].startswith(f"{NS}.{name}.")), None)


async def test_a_gang_the_cluster_cannot_hold_gets_the_nodes_it_asks_the_autoscaler_for(fresh: tuple[str, str],
                                                                                        kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n1", gpus=8, gpu_product=H100)
    autoscaler = FakeAutoscaler(fake, gpus=8, gpu_product=H100, max_nodes=4)
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    cluster = kube_cluster(scale_down_cooldown_s=0)
    config = queues({"class_name": ATOMIC})

    async with kube_api.autopilot(), kube_stack(nats_url, database_url, config, cluster, kube_api.kubeconfig):
        await client.create(job("big", pods=3))  # 24 GPUs: n1 holds one pod, two more nodes are needed
        (request,) = await eventually("the ProvisioningRequest", lambda: _list(fake, PROVISIONING_REQUESTS))
        assert request["spec"]["provisioningClassName"] == ATOMIC
        assert request["metadata"]["name"] == "big-gpuq-1"
        assert request["spec"]["podSets"] == [{"podTemplateRef": {"name": "ppt-big-gpuq-1-main"}, "count": 3}]
        (template,) = fake.store.list(POD_TEMPLATES, NS)
        limits = template["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "8"
        assert [o["kind"] for o in request["metadata"]["ownerReferences"]] == ["Job"]

        fake.controllers.append(autoscaler)  # from now on it answers at every change, as a real one would
        fake.settle_now()

        async def running() -> Any:
            pods = [p for p in fake.store.list(PODS, NS) if p["spec"].get("nodeName")]
            for p in pods:
                if p["status"].get("phase") == "Pending":
                    fake.kubelet.start(NS, p["metadata"]["name"])
            return pods if len(pods) == 3 and all(p["status"].get("phase") == "Running" for p in pods) else None

        try:
            pods = await eventually("the job's 3 pods running", running)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {await _describe(fake, database_url)}") from None
        assert autoscaler.added == ["scaled-1", "scaled-2"]
        assert sorted(p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods) == \
            ["n1", "scaled-1", "scaled-2"]
        assert {p["metadata"]["annotations"][prov.CONSUMES] for p in pods} == {"big-gpuq-1"}
        events = {e["reason"] for e in await workload_events(client, NS, "big")}
        assert {"ProvisioningRequested", "Provisioned"} <= events
        # The job runs: its request and templates are gone; the nodes it runs on are kept from scale-down.
        await eventually("the request released", lambda: _none_left(fake))

        async def kept() -> bool:
            return all((n["metadata"].get("annotations") or {}).get(prov.SCALE_DOWN_DISABLED) == "true"
                       for n in fake.store.list(NODES))

        await eventually("the nodes kept from scale-down", kept)
        assert autoscaler.scale_down() == []
        # It ends: past the cool-down (0 s here) its nodes are released to the autoscaler, which removes them.
        await fake.complete_pods(NS)

        async def released() -> Any:
            annotated = [n for n in fake.store.list(NODES)
                         if prov.IDLE_SINCE in (n["metadata"].get("annotations") or {})]
            return len(annotated) == 3 and all(prov.SCALE_DOWN_DISABLED not in n["metadata"]["annotations"]
                                                for n in annotated)

        await eventually("the idle nodes released", released)
        assert autoscaler.scale_down() == ["scaled-1", "scaled-2"]


async def test_a_failed_request_is_said_asked_again_and_then_not_waited_for(fresh: tuple[str, str],
                                                                             kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n1", gpus=8, gpu_product=H100)
    autoscaler = FakeAutoscaler(fake, gpus=8, gpu_product=H100, max_nodes=1)  # one node more at most
    fake.controllers.append(autoscaler)
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    config = queues({"class_name": ATOMIC, "parameters": {"noRetry": "true"}, "retry_limit": 1, "backoff_s": 0})
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, config, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("huge", pods=3))

        async def failed() -> Any:
            said = [e for e in await workload_events(client, NS, "huge") if e["reason"] == "ProvisioningFailed"]
            return sorted(said, key=lambda e: e["message"]) if len(said) == 2 else None

        first, second = await eventually("two ProvisioningFailed Events", failed)
        assert first["type"] == second["type"] == "Warning"
        assert first["message"].startswith("ProvisioningRequest huge-gpuq-1 failed: CapacityIsNotFound: CA could "
                                           "not find requested capacity; gpuq stopped waiting for it and asks again "
                                           "after ")
        assert second["message"] == ("ProvisioningRequest huge-gpuq-2 failed: CapacityIsNotFound: CA could not find "
                                     "requested capacity; gpuq stopped waiting for it and it is not asked again "
                                     "(retries spent)")
        job_id = await job_id_of(database_url, "huge")
        assert job_id is not None
        lines = await eventually("explain's capacity line", lambda: explain(database_url, job_id))
        assert ("  capacity asked of the autoscaler: ProvisioningRequest ml-team-a/huge-gpuq-2 "
                "(best-effort-atomic-scale-up) failed: CapacityIsNotFound: CA could not find requested capacity; "
                "gpuq stopped waiting for it, not asked again (retries spent)") in lines
        assert lines[0].endswith(": admitted")  # its quota is there: it still waits to be placed
        assert autoscaler.added == []
        assert sorted(r["metadata"]["name"] for r in fake.store.list(PROVISIONING_REQUESTS)) == \
            ["huge-gpuq-1", "huge-gpuq-2"]


async def test_a_queue_that_did_not_opt_in_never_asks(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    fake.add_node("n1", gpus=8, gpu_product=H100)
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, queues(None), kube_cluster(),
                                                kube_api.kubeconfig):
        await client.create(job("big", pods=3))

        async def pending() -> Any:
            return [e for e in await workload_events(client, NS, "big") if e["reason"] == "Pending"]

        await eventually("the Pending Event", pending)
        assert fake.store.list(PROVISIONING_REQUESTS) == [] and fake.store.list(POD_TEMPLATES) == []


async def _list(fake: Any, resource: Any) -> list[dict[str, Any]]:
    return list(fake.store.list(resource))


async def _none_left(fake: Any) -> bool:
    return not fake.store.list(PROVISIONING_REQUESTS) and not fake.store.list(POD_TEMPLATES)


async def _describe(fake: Any, database_url: str) -> str:
    """What the fake and gpuq hold, for a failure's message."""
    pods = [(p["metadata"]["name"], p["spec"].get("nodeName"), p["status"].get("phase"))
            for p in fake.store.list(PODS, NS)]
    requests = [(r["metadata"]["name"], (r.get("status") or {}).get("conditions")) for r in
                fake.store.list(PROVISIONING_REQUESTS)]
    rows = await fetch_status(database_url, None)
    jobs = [(r["job_id"], r["state"], r["reason"], r["message"], r.get("sched_reason"), r.get("sched_message"))
            for r in rows]
    return f"nodes {[n['metadata']['name'] for n in fake.store.list(NODES)]}; pods {pods}; requests {requests}; " \
           f"jobs {jobs}"
