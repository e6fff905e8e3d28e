"""Node pools as flavors on real NATS + Postgres (issue 48, items 4 and 5): admission chooses the node pool of a
job that selects none from its queue's `pools` (the first with quota left), charges that pool's `pool/<name>`
quota in its row and its JobAdmitted, and the scheduler service places it on that pool's nodes only, where
binpacking alone would have put it on the fuller node of the other pool."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.api.readmodel import explain_lines, fetch_status
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, NodeSpec, PodSet
from shared.events import JobSubmitted, NodeInventory, Payload, make_event, utcnow_from
from shared.service import ServiceRuntime, default_subject, publish_event

MODEL = "H100-80GB"
QUEUES: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "pools": ["a", "b"],
                "quotas": {MODEL: {"nominal": 16}, "pool/a": {"nominal": 4}, "pool/b": {"nominal": 8}}}],
}


def spec(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", max_runtime_s=86_400,
                   pod_sets=(PodSet(name="w", count=1, gpus_per_pod=gpus, gpu_models=(MODEL,)),))


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_admission_chooses_the_pool_and_the_scheduler_places_there(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    admission = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                               clock=clock, database_url=database_url)
    scheduler = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)

    async def send(payload: Payload) -> None:
        await publish_event(js, make_event(payload, source="test", time=utcnow_from(clock.now())),
                            default_subject(payload))

    async def placed_on(job_id: str) -> set[str] | None:
        raw = await conn.fetchval("SELECT bindings FROM scheduler.v1_placements WHERE job_id = $1", job_id)
        return None if raw is None else {b["node"] for b in json.loads(raw)}

    async def is_placed(job_id: str) -> bool:
        return await placed_on(job_id) is not None

    async def admitted_event(job_id: str) -> dict[str, Any]:
        rows = await conn.fetch("SELECT body FROM admission.outbox WHERE subject LIKE '%.job.admitted' ORDER BY seq")
        [data] = [d for r in rows if (d := json.loads(bytes(r["body"]))["data"])["job_id"] == job_id]
        return data

    await scheduler.start()
    await admission.start()
    try:
        # n-a (pool a) and n-b (pool b), one rack: binpack puts a second 4-GPU job on the half-full n-a
        await send(NodeInventory(nodes=tuple(
            NodeSpec(name=f"n-{p}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20, rack="r-0",
                     block="b-0", labels={"pool": p}) for p in ("a", "b"))))
        await send(JobSubmitted(spec=spec("j0", 4)))
        await until(lambda: is_placed("j0"))
        await send(JobSubmitted(spec=spec("j1", 4)))  # pool a's quota (4) is spent: pool b
        await until(lambda: is_placed("j1"))
        assert await placed_on("j0") == {"n-a"}
        assert await placed_on("j1") == {"n-b"}
        usage = {r["job_id"]: json.loads(r["usage"]) for r in await conn.fetch(
            "SELECT job_id, usage FROM admission.jobs WHERE job_id = ANY($1::text[])", ["j0", "j1"])}
        assert usage == {"j0": {MODEL: 4, "pool/a": 4}, "j1": {MODEL: 4, "pool/b": 4}}
        event = await admitted_event("j1")
        assert event["quota"] == {MODEL: 4, "pool/b": 4}
        assert event["spec"]["pod_sets"][0]["node_selector"] == {"pool": "b"}
        # what `gpuq explain` says of it
        [status] = await fetch_status(database_url, "j1")
        assert "  quota charged: H100-80GB:4, pool/b:4; on node pool b" in explain_lines(status, clock.now())
        # the row keeps the spec as submitted: a requeue chooses again
        row_spec = json.loads(await conn.fetchval("SELECT spec FROM admission.jobs WHERE job_id = 'j1'"))
        assert "pool" not in row_spec["pod_sets"][0].get("node_selector", {})
        # a third job finds no pool with quota left and says where it waits
        await send(JobSubmitted(spec=spec("j2", 8)))

        async def waiting() -> bool:
            r = await conn.fetchrow("SELECT status, message FROM admission.jobs WHERE job_id = 'j2'")
            return r is not None and r["status"] == "pending" and r["message"] is not None
        await until(waiting)
        message = await conn.fetchval("SELECT message FROM admission.jobs WHERE job_id = 'j2'")
        assert "on node pool b (queue team-a tries pools a, b in that order)" in message
    finally:
        await admission.stop()
        await scheduler.stop()
        await nc.close()
        await conn.close()
        await pool.close()
