"""One job's whole life over the real bus: submit → admission → scheduler → simulated executor → completed.

Every hop crosses JetStream and commits to Postgres; the status read model shows the result; a forced
redelivery of every event changes nothing."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats

from services.api.readmodel import fetch_status
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet, TopologyLevel, TopologyRequest
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 4, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 16}}},
    ],
})


def job(job_id: str, team: str, pods: int, gpus: int, duration_s: int, **kw: object) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=pods, gpus_per_pod=gpus),),
                   max_runtime_s=duration_s * 2, labels={"sim.gpuq.io/duration-s": str(duration_s)}, **kw)


async def wait_until(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if await predicate():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting for the slice")
        await asyncio.sleep(0.1)


async def test_submit_to_completed_over_the_bus(fresh: tuple[str, str], tmp_path: Path) -> None:
    nats_url, database_url = fresh
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor"), clock=ScaledClock(200.0))
    jobs = [
        job("gang-8x2", "team-a", pods=2, gpus=8, duration_s=200,
            topology=TopologyRequest(required_level=TopologyLevel.RACK)),
        job("single-1", "team-b", pods=1, gpus=1, duration_s=100),
        job("quad-4", "team-b", pods=1, gpus=4, duration_s=150),
        JobSpec(job_id="intruder", team="team-b", queue="team-a", pod_sets=(PodSet(),)),
    ]
    trace_ids = {s.job_id: f"{i + 1:032x}" for i, s in enumerate(jobs)}
    events = [make_event(JobSubmitted(spec=s, submitted_at=datetime.now(UTC)), source="test", time=datetime.now(UTC),
                         traceparent=f"00-{trace_ids[s.job_id]}-{'a' * 16}-01") for s in jobs]
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        for e in events:
            await publish_event(js, e, ns_subject(f"job.submitted.{e.data['spec']['team']}"))

        async def all_done() -> bool:
            rows = await fetch_status(database_url, None)
            return sum(r["state"] in ("completed", "rejected") for r in rows) == 4

        await wait_until(all_done)
        rows = {r["job_id"]: r for r in await fetch_status(database_url, None)}
        assert rows["intruder"]["state"] == "rejected" and rows["intruder"]["reason"] == "Unauthorized"
        assert {rows[j]["state"] for j in ("gang-8x2", "single-1", "quad-4")} == {"completed"}
        gang = await fetch_status(database_url, "gang-8x2")
        assert len(gang[0]["nodes"]) == 2 and gang[0]["racks_spanned"] == 1  # one rack, whole gang

        # Force a redelivery of every submission and completion: nothing may change twice.
        conn = await asyncpg.connect(database_url)
        before = await conn.fetchval("SELECT count(*) FROM admission.outbox")
        runs_before = await conn.fetch("SELECT job_id, attempt FROM executor.runs ORDER BY job_id")
        for i, e in enumerate(events):
            await js.publish(ns_subject(f"job.submitted.{e.data['spec']['team']}"), e.model_dump_json().encode(),
                             headers={"Nats-Msg-Id": f"again-{i}"})
        await asyncio.sleep(2.0)
        assert await conn.fetchval("SELECT count(*) FROM admission.outbox") == before
        assert await conn.fetch("SELECT job_id, attempt FROM executor.runs ORDER BY job_id") == runs_before
        placed = await conn.fetchval("SELECT count(*) FROM scheduler.outbox WHERE subject = $1",
                                     ns_subject("job.placed"))
        assert placed == 3
        # Trace context crossed every hop: each completion belongs to its submission's trace.
        sub = await js.subscribe(ns_subject("job.completed"), ordered_consumer=True)
        completed = {}
        for _ in range(3):
            msg = await sub.next_msg(timeout=5)
            body = json.loads(msg.data)
            completed[body["subject"]] = body["traceparent"].split("-")[1]
        assert completed == {j: trace_ids[j] for j in ("gang-8x2", "single-1", "quad-4")}
        audit = await conn.fetch("SELECT actor, action, job_id FROM admission.audit")
        # (besides admission's record of the configuration it started with: config_applied)
        assert [(a["action"], a["job_id"]) for a in audit if not a["action"].startswith("config_")] == [
            ("reject", "intruder")]
        await conn.close()
        await nc.close()
