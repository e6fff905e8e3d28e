"""Freed GPUs go to the preemptor that asked (issue 51), over the real bus and database: team A's high-priority
job preempts team A's own low-priority job, while team B's job, admitted before it, waits for GPUs. Before the
fix the scheduler placed team B's job on the freed node as soon as the victim's JobPreempted arrived (admission
admits the preemptor only once that preemption released its quota), and the preemptor waited for team B's job
to end."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import nats

from services.api.readmodel import fetch_status
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import CheckpointSpec, JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event
from tests.system.reclaim_story import wait_until

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576},
]})
# Two teams, each guaranteed the one node's 8 GPUs (no cohort: nobody borrows); admission is quota-only, so team
# B's job is admitted while team A's job holds the node, and waits for placement.
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "queues": [
        {"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
        {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "policy": {"protection_window_s": 60, "checkpoint_grace_s": 300},
})


def job_spec(job_id: str, team: str, klass: str, duration_s: int, *, checkpoint: bool = False) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team, priority_class=klass,
                   pod_sets=(PodSet(count=1, gpus_per_pod=8),), checkpoint=CheckpointSpec(supported=checkpoint),
                   max_runtime_s=20_000, labels={"sim.gpuq.io/duration-s": str(duration_s)})


async def _placements(nats_url: str) -> list[str]:
    nc = await nats.connect(nats_url)
    sub = await nc.jetstream().subscribe(ns_subject("job.placed"), ordered_consumer=True)
    out = []
    while True:
        try:
            out.append(json.loads((await sub.next_msg(timeout=0.5)).data)["data"]["job_id"])
        except TimeoutError:
            break
    await nc.close()
    return out


async def test_the_preemptor_gets_the_gpus_it_freed(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "preemption", "executor"), clock=clock)
    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()

        async def submit(spec: JobSpec) -> None:
            now = datetime.fromtimestamp(clock.now(), UTC)
            await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(spec.team))

        async def state(job_id: str) -> str:
            rows = await fetch_status(database_url, job_id)
            return rows[0]["state"] if rows else "unknown"

        async def is_(job_id: str, wanted: str) -> bool:
            return await state(job_id) == wanted

        await submit(job_spec("a-low", "team-a", "low", 5000, checkpoint=True))
        await wait_until(lambda: is_("a-low", "running"))
        await submit(job_spec("b-job", "team-b", "low", 300))
        await wait_until(lambda: is_("b-job", "admitted"))  # admitted (team B's quota is free), no GPUs
        await asyncio.sleep(1.0)  # 100 virtual seconds: a-low is past its 60 s protection window
        await submit(job_spec("a-high", "team-a", "high", 300))
        await wait_until(lambda: is_("a-high", "running"))
        await wait_until(lambda: is_("b-job", "completed"))
        await nc.close()

    placed = await _placements(nats_url)
    # a-low first; then the preemptor on the GPUs it freed, before team B's job (which waited for it to end)
    assert placed[:3] == ["a-low", "a-high", "b-job"], placed
    conn = await asyncpg.connect(database_url)
    try:
        preempted = await conn.fetch("SELECT victim, preemptor FROM preemption.preemptions "
                                     "WHERE state = 'preempted'")
        assert [(r["victim"], r["preemptor"]) for r in preempted] == [("a-low", "a-high")]
        assert await conn.fetchval("SELECT count(*) FROM scheduler.holds") == 0  # released once a-high was placed
    finally:
        await conn.close()
