"""The metering ServiceSpec under the shared runtime's unit of work (inbox + handler in one transaction)."""

from __future__ import annotations

import pytest

from services.metering import store
from services.metering.app import SPEC
from services.metering.testing import scenario
from shared.events import UtilizationSampled, encode_event
from shared.service import ServiceRuntime


def test_spec_declares_the_metering_events():
    assert SPEC.name == SPEC.schema == "metering"
    assert (SPEC.migrations / "001_init.sql").exists()
    names = {cls.__name__ for cls in SPEC.handlers}
    assert {"JobPlaced", "JobStarted", "JobCompleted", "JobFailed", "JobCancelled", "JobPreempted",
            "UtilizationSampled"} <= names


@pytest.mark.asyncio(loop_scope="session")
async def test_runtime_handles_each_event_once(pool):
    runtime = ServiceRuntime(SPEC, nats_url="nats://127.0.0.1:1", pool=pool)  # never connects: handle() only
    raws = [encode_event(ev) for ev in scenario()]
    assert {await runtime.handle(raw) for raw in raws} == {"handled"}
    assert {await runtime.handle(raw) for raw in raws[:20]} == {"duplicate"}
    async with pool.acquire() as conn:
        inbox = await conn.fetchval("SELECT count(*) FROM metering.inbox")
        summary = await store.team_summary(conn)
    assert inbox == len(raws)
    assert [(r["team"], r["allocated_gpu_hours"], r["used_gpu_hours"]) for r in summary] == [
        ("team-a", 16.0, 8.0), ("team-b", 8.0, 0.0)]
    assert sum(1 for ev in scenario() if ev.type == UtilizationSampled.event_type()) == 120


@pytest.mark.asyncio(loop_scope="session")
async def test_build_spec_seeds_prices_from_the_stack_queues(pool):
    from types import SimpleNamespace

    from services.metering.app import build_spec
    from services.metering.testing import QUEUES_DOC
    from shared.clock import ManualClock
    from shared.config import parse_queues

    spec = build_spec(SimpleNamespace(queues=parse_queues(QUEUES_DOC)))
    runtime = ServiceRuntime(spec, nats_url="nats://127.0.0.1:1", pool=pool, clock=ManualClock())
    assert spec.on_start is not None
    await spec.on_start(runtime)
    async with pool.acquire() as conn:
        assert await store.load_rates(conn) == {"A100-40GB": 2.0, "H100-80GB": 4.0}
