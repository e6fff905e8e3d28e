"""Handlers write the core's records in the event's transaction; a restarted service rebuilds the same
gauges from its tables and, for the nodes, from the scheduler's read model (it keeps no node table of its own)."""

from __future__ import annotations

import asyncpg
import pytest

from services.scheduler.nodes import record_node
from services.telemetry.app import TelemetryService
from shared.clock import ManualClock
from shared.domain import NodeHealth
from shared.events import ExitReason, NodeChanged, QueueConfigChanged, make_event, utcnow_from
from shared.service import Tx
from tests.unit.telemetry.telemetry_builders import T0, checkpointed, inventory, life, node, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def handle(svc: TelemetryService, pool: asyncpg.Pool, events: list) -> None:
    for t, payload in sorted(events, key=lambda e: e[0]):
        event = make_event(payload, source="test", time=utcnow_from(T0 + t))
        async with pool.acquire() as conn, conn.transaction():
            await svc.on_event(Tx(conn=conn, now=T0 + t, source="test", schema="telemetry"), event, payload)


async def test_restart_rebuilds_the_same_gauges(pool: asyncpg.Pool) -> None:
    clock = ManualClock(T0 + 1000)
    svc = TelemetryService(metrics_port=None, clock=clock, webhook_worker=False)
    try:
        nodes = (node("n0"), node("n1"), node("n2", health=NodeHealth.DEGRADED))
        await handle(svc, pool, [(0, inventory(*nodes[:2])),
                                 (1, NodeChanged(node=nodes[2], reason="Xid79", message="fell off the bus"))])
        async with pool.acquire() as conn:  # what the scheduler records of the same events (their one owner)
            for n in nodes[:2]:
                await record_node(conn, n, at=T0)
            await record_node(conn, nodes[2], at=T0 + 1, reason="Xid79", message="fell off the bus")
            assert await conn.fetchval("SELECT to_regclass('telemetry.nodes')") is None
        await handle(svc, pool, life(spec("a", gpus_per_pod=4), {"n0": [0, 1, 2, 3]}, 1, 10, 1, end=None))
        await handle(svc, pool, life(spec("b", team="team-b"), {"n1": [0]}, 2, 10, 300, end=ExitReason.OOM_KILLED))
        await handle(svc, pool, life(spec("c", team="team-b", pods=4, gpus_per_pod=8), {}, 3, 1, 1)[:2])
        await handle(svc, pool, [(500, checkpointed("a", 500))])
        await handle(svc, pool, [(600, QueueConfigChanged(config={
            "priority_classes": [{"name": "normal", "value": 1}],
            "queues": [{"name": "team-a", "quotas": {"H100": {"nominal": 20}}}]}))])
        before = svc.snapshot()
        assert sorted(r["job_id"] for r in await pool.fetch("SELECT job_id FROM telemetry.jobs")) == ["a", "c"]

        restarted = TelemetryService(metrics_port=None, clock=clock, webhook_worker=False)
        try:
            async with pool.acquire() as conn:
                await restarted.load(conn)
            assert restarted.snapshot() == before
            assert restarted.state.node_doc("n2") == svc.state.node_doc("n2")
            assert restarted.state.nodes["n2"].reason == "Xid79"
            assert before["gpuq_quota_guaranteed_gpus"] == {(("gpu_model", "H100"),): 20}
            assert before["gpuq_gpus_allocated"]
        finally:
            restarted.metrics.shutdown()
    finally:
        svc.metrics.shutdown()
