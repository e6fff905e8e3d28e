"""Idle reclaim's warning on the workload (issue 48): a notebook Job runs on the fake API server; telemetry's
JobIdleWarned (as tests/service/telemetry/test_telemetry_idle_restart.py shows it emitted) becomes a Warning Event
`GpuIdle` on the Job, whose message names the threshold, the idle time, the grace and when it is reclaimed. A warning
for a job that is not running shows nothing. (Fails on the code before: the executor took no such fact.)"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import nats

from shared.config import parse_queues
from shared.events import JobIdleWarned, make_event
from shared.service import default_subject, publish_event
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack, workload_events
from tests.service.kube.test_kube_executor import JOB, job

NS = "ml-team-a"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 32}}}],
    "namespaces": [{"name": NS, "team": "team-a", "queues": ["team-a"]}],
})


async def warn(nats_url: str, job_id: str) -> None:
    now = datetime.now(UTC)
    message = (f"{job_id}'s GPUs have been below 5% for 1800s; it is requeued in 900s unless they are used")
    payload = JobIdleWarned(job_id=job_id, team="team-a", user="alice", idle_since=now - timedelta(seconds=1800),
                            deadline=now + timedelta(seconds=900), action="requeue", message=message)
    nc = await nats.connect(nats_url)
    await publish_event(nc.jetstream(), make_event(payload, source="gpuq/telemetry", time=now),
                        default_subject(payload))
    await nc.close()


async def test_an_idle_warning_is_a_warning_event_on_the_workload(fresh: tuple[str, str], kube_api: Any) -> None:
    nats_url, database_url = fresh
    kube_api.fake.add_node("n1", gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    await kube_api.create_namespace(NS)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("nb", annotations={"gpuq.io/kind": "notebook"}))
        await client.create(job("waiting", pods=2))  # 16 GPUs on a node of 8: it waits (never running)
        await kube_api.run_pods_to_ready(NS, "gpuq.io/job", count=1)
        (started,) = await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))
        assert started["job_id"].startswith(f"{NS}.nb.")
        queued = [q["job_id"] for q in await eventually("both queued", lambda: _two(nats_url))
                  if q["job_id"] != started["job_id"]]
        await warn(nats_url, queued[0])  # not running: nothing to show
        await warn(nats_url, started["job_id"])

        async def idle_events() -> list[dict[str, Any]]:
            return [e for e in await workload_events(client, NS, "nb") if e["reason"] == "GpuIdle"]

        (event,) = await eventually("the GpuIdle Event", idle_events)
        assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Job"
        assert "below 5% for 1800s" in event["message"] and "in 900s" in event["message"]
        assert "reclaimed at " in event["message"]
        other = (await client.get(JOB, "waiting", namespace=NS)).to_dict()
        assert other["spec"]["suspend"] is True
        assert not [e for e in await workload_events(client, NS, "waiting") if e["reason"] == "GpuIdle"]


async def _two(nats_url: str) -> list[dict[str, Any]] | None:
    queued = await bus_events(nats_url, "job.queued")
    return queued if len(queued) >= 2 else None
