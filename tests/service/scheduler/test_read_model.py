"""The scheduler's cluster read model (scheduler.v1_nodes / v1_placements through services/scheduler/readmodel.py):
what other services read instead of mirroring nodes and placements, on a real scheduler fed over NATS."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from datetime import timedelta

import asyncpg
import nats

from services.scheduler import readmodel
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.db import create_pool
from shared.domain import NodeHealth
from shared.events import JobCompleted, JobStarted, NodeChanged, NodeInventory, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.scheduler.test_scheduler_service import NODES, T0, admitted, wait_for


class Rollback(Exception):
    pass


async def test_nodes_and_placements_as_the_scheduler_knows_them(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    conn = await asyncpg.connect(database_url)
    # Before the owner ever ran on this database: an empty cluster, not an error.
    assert await readmodel.nodes(conn) == [] and await readmodel.placements(conn) == []
    pool = await create_pool(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    runtime = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url)
    await runtime.start()
    try:
        async def send(payload) -> None:  # type: ignore[no-untyped-def]
            await js.publish(payload.subject(), encode_event(make_event(payload, source="test", time=T0)))

        await send(NodeInventory(nodes=NODES))
        degraded = NODES[3].model_copy(update={"health": NodeHealth.DEGRADED})
        await send(NodeChanged(node=degraded, reason="Xid79", message="GPU fell off the bus"))
        await send(NodeChanged(node=NODES[2], change="removed"))
        await js.publish(ns_subject("job.admitted"), admitted("small", 1, 4))

        async def settled() -> bool:
            return len(await readmodel.placements(conn)) == 1 and len(await readmodel.nodes(conn)) == 3

        await wait_for(settled)
        facts = {f.name: f for f in await readmodel.node_facts(conn, include_removed=True)}
        assert sorted(facts) == sorted(n.name for n in NODES)
        assert facts[NODES[2].name].removed and facts[NODES[2].name].spec.health is NodeHealth.FAILED
        assert (facts[NODES[3].name].spec.health, facts[NODES[3].name].reason,
                facts[NODES[3].name].message) == (NodeHealth.DEGRADED, "Xid79", "GPU fell off the bus")
        assert facts[NODES[0].name].reason is None and not facts[NODES[0].name].removed
        assert [n.name for n in await readmodel.nodes(conn)] == [NODES[0].name, NODES[1].name, NODES[3].name]

        rows = await readmodel.cluster_rows(conn)  # one snapshot, in a transaction of its own or the caller's
        async with conn.transaction():
            assert await readmodel.cluster_rows(conn) == rows
        assert [f.name for f in readmodel.node_facts_of(rows.nodes)] == [n.name for n in await readmodel.nodes(conn)]
        (p,) = readmodel.placements_of(rows.placements)
        assert p == (await readmodel.placements(conn))[0]
        assert p.job_id == "small" and p.flavors == {"main": "H100"}
        assert sum(len(b.gpu_indices) for b in p.bindings) == 4 and p.fencing_token is not None
        assert p.expected_end == p.placed_at + p.spec.max_runtime_s  # before the start: from the placement
        assert p.started_at is None
        assert await readmodel.placements(conn, ["small", "unknown"]) == [p]  # a reader may ask for some jobs only
        assert await readmodel.placements(conn, []) == []
        await send(JobStarted(job_id="small", started_at=T0 + timedelta(seconds=30)))

        async def started() -> bool:
            return all(x.expected_end != x.placed_at + x.spec.max_runtime_s for x in await readmodel.placements(conn))

        await wait_for(started)
        (p,) = await readmodel.placements(conn)
        assert p.expected_end == T0.timestamp() + 30 + p.spec.max_runtime_s  # the real start + the user's limit
        assert p.started_at == T0.timestamp() + 30  # the executor-reported start (v1 column added by 004)

        # A reader one release ahead of the scheduler (rolling upgrade: the view as 003 made it, no started_at)
        # reads the other columns as before and no start.
        with contextlib.suppress(Rollback):
            async with conn.transaction():
                await conn.execute("DROP VIEW scheduler.v1_placements")
                await conn.execute(
                    "CREATE VIEW scheduler.v1_placements AS SELECT job_id, spec, flavors, bindings, placed_at, "
                    "coalesce(expected_end, placed_at + (spec ->> 'max_runtime_s')::double precision) "
                    "AS expected_end, fencing_token FROM scheduler.jobs WHERE status = 'placed'")
                (old,) = await readmodel.placements(conn)
                assert old == replace(p, started_at=None)
                raise Rollback
        assert await readmodel.placements(conn) == [p]  # rolled back: the view as 004 made it
        await send(JobCompleted(job_id="small", finished_at=T0))

        async def released() -> bool:
            return await readmodel.placements(conn) == []

        await wait_for(released)
    finally:
        await runtime.stop()
        await nc.close()
        await pool.close()
        await conn.close()
