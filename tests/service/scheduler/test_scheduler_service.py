"""The scheduler service on real NATS + Postgres: placements survive a restart, redeliveries place nothing
twice, an unplaceable job carries its reason, and a standby takes over from a leader that went away."""

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
from shared.domain import JobSpec, PodSet, TopologyLevel, TopologyRequest
from shared.events import JobAdmitted, JobCompleted, NodeInventory, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

NODES = tuple(parse_cluster({"node_groups": [
    {"name": "h100", "count": 4, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000, "memory_mib": 512000,
     "nodes_per_rack": 2}]}).nodes())
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def admitted(job_id: str, pods: int, gpus: int, **kw: object) -> bytes:
    spec = JobSpec(job_id=job_id, team="t", queue="t", pod_sets=(PodSet(count=pods, gpus_per_pod=gpus),), **kw)
    return encode_event(make_event(JobAdmitted(job_id=job_id, spec=spec, flavors={"main": "H100"},
                                               admitted_at=T0), source="test", time=T0))


async def wait_for(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_restart_redelivery_reasons_and_takeover(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def placed_count() -> int:
        return await conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE status = 'placed'") or 0

    first = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                           database_url=database_url)
    await first.start()
    standby = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url, instance="1")
    standby_task = asyncio.create_task(standby.start())  # waits for the lease
    try:
        inventory = make_event(NodeInventory(nodes=NODES), source="test", time=T0)
        await js.publish(ns_subject("node.inventory"), encode_event(inventory))
        await js.publish(ns_subject("job.admitted"), admitted("gang", 2, 8,
                                                       topology=TopologyRequest(required_level=TopologyLevel.RACK)))
        await js.publish(ns_subject("job.admitted"), admitted("small", 1, 4))
        await wait_for(lambda: _ge(placed_count(), 2))
        gang = json.loads(await conn.fetchval("SELECT bindings FROM scheduler.jobs WHERE job_id = 'gang'"))
        assert len({b["node"] for b in gang}) == 2
        token = await conn.fetchval("SELECT fencing_token FROM scheduler.jobs WHERE job_id = 'gang'")
        assert not standby_task.done()  # the standby is still waiting

        # The leader goes away; the standby takes over with a higher term and the state rebuilt from Postgres.
        await first.stop()
        await asyncio.wait_for(standby_task, timeout=15)
        assert standby.lease is not None and standby.lease.term == token + 1
        # A job that cannot be placed carries a machine reason and a message with the numbers.
        await js.publish(ns_subject("job.admitted"), admitted("too-big", 3, 8,
                                                       topology=TopologyRequest(required_level=TopologyLevel.RACK)))
        await wait_for(lambda: _reason_is(conn, "too-big"))
        row = await conn.fetchrow("SELECT reason, message FROM scheduler.jobs WHERE job_id = 'too-big'")
        assert row["reason"] in ("InsufficientGpus", "TopologyUnsatisfiable") and "24" in row["message"], row
        # A completion delivered twice (new Nats-Msg-Id, same event) releases once and places nothing twice.
        # The finished gang frees its rack; the waiting job is placed by the new leader.
        done = make_event(JobCompleted(job_id="gang", finished_at=T0), source="test", time=T0)
        await js.publish(ns_subject("job.completed"), encode_event(done))
        await js.publish(ns_subject("job.completed"), encode_event(done), headers={"Nats-Msg-Id": "again"})
        await wait_for(lambda: _ge(standby_duplicates(standby), 1))
        outbox = await conn.fetchval("SELECT count(*) FROM scheduler.outbox WHERE subject = $1",
                                     ns_subject("job.placed"))
        assert outbox == 2  # gang and small only: nothing placed twice, too-big still cannot fit 24 GPUs in a rack
    finally:
        await standby.stop()
        await first.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def standby_duplicates(runtime: ServiceRuntime) -> int:
    return runtime.counters.duplicates


async def _ge(value, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await value) >= n


async def _reason_is(conn: asyncpg.Connection, job_id: str) -> bool:
    return await conn.fetchval("SELECT reason IS NOT NULL FROM scheduler.jobs WHERE job_id = $1", job_id) or False
