"""The telemetry ServiceSpec on the shared runtime, real JetStream and Postgres: events published on the
bus reach /metrics, and a subscribed team's webhook receives the signed event."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import httpx
import nats
import pytest

from services.telemetry.app import TelemetryService
from services.telemetry.webhooks import store
from shared.db import create_pool
from shared.events import JobCompleted, JobPlaced, JobStarted, JobSubmitted, NodeInventory, make_event, utcnow_from
from shared.service import ServiceRuntime, publish_event
from tests.service.telemetry.telemetry_receiver import LOOPBACK, Receiver
from tests.unit.telemetry.telemetry_builders import bindings, node, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def eventually(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if await check():
                return
        except (httpx.HTTPError, AssertionError):
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.2)


async def test_bus_to_metrics_and_webhook(fresh: tuple[str, str]) -> None:
    nats_url, db_url = fresh
    pool: asyncpg.Pool = await create_pool(db_url)
    svc = TelemetryService(metrics_port=0, metrics_addr="127.0.0.1", allow=LOOPBACK)
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool)
    receiver = Receiver([])
    nc = await nats.connect(nats_url)
    try:
        await runtime.start()
        async with pool.acquire() as conn:
            sub = await store.add_subscription(conn, receiver.url, "team-a", ["job.completed"])
        receiver.secret = sub.secret
        now = time.time()
        s = spec("bus-1", team="team-a", gpus_per_pod=2)
        js = nc.jetstream()
        for payload in (NodeInventory(nodes=(node("h0"),)), JobSubmitted(spec=s),
                        JobPlaced(job_id="bus-1", spec=s, bindings=bindings(s, {"h0": [0, 1]}),
                                  placed_at=utcnow_from(now)),
                        JobStarted(job_id="bus-1", started_at=utcnow_from(now))):
            await publish_event(js, make_event(payload, source="test", time=utcnow_from(now)), payload.subject())

        async def allocated() -> bool:
            assert svc.bound_port
            text = httpx.get(f"http://127.0.0.1:{svc.bound_port}/metrics", timeout=2).text
            return 'gpuq_gpus_allocated{gpu_model="H100",pool="training",queue="team-a",team="team-a"} 2.0' in text

        await eventually(allocated)
        done = make_event(JobCompleted(job_id="bus-1", finished_at=utcnow_from(now + 5)), source="test",
                          time=utcnow_from(now + 5))
        await publish_event(js, done, JobCompleted.subject())

        async def delivered() -> bool:
            return any(h["webhook-id"] == done.id and ok for h, _, ok in receiver.requests)

        await eventually(delivered)
        assert await pool.fetchval("SELECT count(*) FROM telemetry.jobs") == 0
    finally:
        await runtime.stop()
        await nc.close()
        receiver.close()
        await pool.close()
