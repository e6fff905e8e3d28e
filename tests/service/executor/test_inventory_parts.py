"""A cluster too big for one NATS message starts: the simulated executor announces its 5,000 nodes in parts (one
event of them all would be about 1.1 MB, above NATS's 1 MiB max_payload, and its outbox row would never publish),
and the scheduler, reading them off the bus, knows every node and places."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import nats

from services.executor.sim import SimExecutor, SimExecutorSettings
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_cluster
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import INVENTORY_CHUNK, JobAdmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

NODES = 5_000
T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_a_5000_node_cluster_is_announced_in_parts_and_the_scheduler_knows_every_node(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    cluster = parse_cluster({"node_groups": [
        {"name": "h100", "count": NODES, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000,
         "memory_mib": 512000, "nodes_per_rack": 4}]})
    pool = await create_pool(database_url)
    executor = ServiceRuntime(SimExecutor(SimExecutorSettings(cluster=cluster)).spec(), nats_url=nats_url,
                              pool=pool, clock=ManualClock())
    scheduler = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                               database_url=database_url)
    await scheduler.start()
    await executor.start()
    nc = await nats.connect(nats_url)
    try:
        deadline = asyncio.get_running_loop().time() + 120
        while await pool.fetchval("SELECT count(*) FROM scheduler.nodes") < NODES:
            assert asyncio.get_running_loop().time() < deadline, "the scheduler did not learn every node"
            await asyncio.sleep(0.2)
        assert executor.counters.dead_lettered == 0
        assert await pool.fetchval("SELECT count(*) FROM executor.dead_letters") == 0
        parts = await pool.fetch("SELECT length(body) AS size FROM executor.outbox WHERE subject = $1",
                                 ns_subject("node.inventory"))
        assert len(parts) == NODES // INVENTORY_CHUNK and max(p["size"] for p in parts) < 512 * 1024
        names = {r["name"] for r in await pool.fetch("SELECT name FROM scheduler.nodes")}
        assert names == set(SimExecutor(SimExecutorSettings(cluster=cluster)).nodes)
        # and in memory, where it places: a 1-GPU job is placed
        spec = JobSpec(job_id="small", team="t", queue="t", pod_sets=(PodSet(count=1, gpus_per_pod=1),))
        event = make_event(JobAdmitted(job_id="small", spec=spec, flavors={"main": "H100"}, admitted_at=T0),
                           source="test", time=T0)
        await nc.jetstream().publish(ns_subject("job.admitted"), encode_event(event))
        while await pool.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'small'") != "placed":
            assert asyncio.get_running_loop().time() < deadline, "the job was not placed"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
        await executor.stop()
        await scheduler.stop()
        await pool.close()
