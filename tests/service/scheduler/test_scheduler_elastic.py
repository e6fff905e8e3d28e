"""An elastic job through the scheduler service on real NATS + Postgres (issue 48 item 2): the service places it at
its floor, what admission charged; it grows only with admission's grant (test_elastic_resizes.py)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import nats

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_cluster
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobAdmitted, NodeInventory, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

NODES = tuple(parse_cluster({"node_groups": [
    {"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000, "memory_mib": 512000}]
}).nodes())
T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_the_service_places_an_elastic_job_at_its_floor(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    runtime = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url)
    await runtime.start()
    try:
        await js.publish(ns_subject("node.inventory"),
                         encode_event(make_event(NodeInventory(nodes=NODES), source="test", time=T0)))
        spec = JobSpec(job_id="el", team="t", queue="t",
                       pod_sets=(PodSet(name="worker", count=8, min_count=3, gpus_per_pod=1),))
        await js.publish(ns_subject("job.admitted"), encode_event(make_event(
            JobAdmitted(job_id="el", spec=spec, flavors={"worker": "H100"}, admitted_at=T0), source="test", time=T0)))
        deadline = asyncio.get_running_loop().time() + 20
        while await conn.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'el'") != "placed":
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await asyncio.sleep(0.1)
        bindings = json.loads(await conn.fetchval("SELECT bindings FROM scheduler.jobs WHERE job_id = 'el'"))
        # 16 GPUs free: the decision core would start it with all 8, the service starts its floor of 3
        assert sorted(b["pod"] for b in bindings) == ["worker-0", "worker-1", "worker-2"]
    finally:
        await runtime.stop()
        await nc.close()
        await conn.close()
        await pool.close()
