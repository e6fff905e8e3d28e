"""The runtime's batch path (utilisation samples): one transaction per pulled batch, with the same guarantees
as the per-message path — a redelivered event counts once, a poison message is dead-lettered with its reason."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import nats

from services.metering.app import build_spec
from services.stack import StackSettings
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.events import GpuSample, UtilizationSampled, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

QUEUES = parse_queues({"priority_classes": [{"name": "normal", "value": 1}], "queues": [{"name": "q"}]})


async def test_samples_in_batches_count_once_and_poison_is_dead_lettered(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    spec = build_spec(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES))
    assert spec.batch_handlers, "metering consumes samples through the batch path"
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.start()
    try:
        t0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
        events = [make_event(UtilizationSampled(
            node=f"n{i % 5}", gpu_model="H100", sampled_at=datetime.fromtimestamp(t0 + 60 * i, UTC), interval_s=60,
            samples=tuple(GpuSample(job_id="job-1", gpu_index=g, utilization_pct=50.0, power_w=300.0)
                          for g in range(8))), source="test", time=datetime.now(UTC)) for i in range(100)]
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        for e in events:
            await js.publish(ns_subject("utilization.sampled"), encode_event(e), headers={"Nats-Msg-Id": e.id})
        await js.publish(ns_subject("utilization.sampled"), b"not json at all")
        for e in events[:10]:  # the same events again, past publish dedup: what a lost ack looks like
            await js.publish(ns_subject("utilization.sampled"), encode_event(e),
                             headers={"Nats-Msg-Id": f"again-{e.id}"})
        await nc.close()
        deadline = asyncio.get_running_loop().time() + 30
        while runtime.counters.handled + runtime.counters.duplicates < 110 or runtime.counters.dead_lettered < 1:
            assert asyncio.get_running_loop().time() < deadline, runtime.counters
            await asyncio.sleep(0.1)
        assert runtime.counters.handled == 100 and runtime.counters.duplicates == 10
        assert await pool.fetchval("SELECT count(*) FROM metering.gpu_samples") == 800
        assert await pool.fetchval("SELECT reason FROM metering.dead_letters") == "MalformedJson"
    finally:
        await runtime.stop()
        await pool.close()


async def test_a_failed_batch_falls_back_to_one_by_one_and_loses_no_sample(fresh: tuple[str, str]) -> None:
    """A batch that Postgres refuses as a whole (here one sample whose GPU index no integer column holds: it passes
    validation, and fails in Postgres) rolls back, and its messages are handled one by one: every good sample is
    recorded and the bad one is dead-lettered at once (Postgres refuses the same data on every delivery), never
    acked as if no handler took it."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    spec = build_spec(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES))
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    t0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()

    def sample(i: int, node: str, first_gpu: int = 0) -> bytes:
        return encode_event(make_event(UtilizationSampled(
            node=node, gpu_model="H100", sampled_at=datetime.fromtimestamp(t0 + 60 * i, UTC), interval_s=60,
            samples=tuple(GpuSample(job_id="job-1", gpu_index=first_gpu + g, utilization_pct=50.0)
                          for g in range(8))),
            source="test", time=datetime.now(UTC)))

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    for i in range(20):  # published before the consumer starts: they arrive in one pull with the bad one
        await js.publish(ns_subject("utilization.sampled"), sample(i, f"n{i}", 2**40 if i == 10 else 0))
    await nc.close()
    await runtime.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while runtime.counters.handled < 19 or runtime.counters.dead_lettered < 1:
            assert asyncio.get_running_loop().time() < deadline, runtime.counters
            await asyncio.sleep(0.1)
        assert await pool.fetchval("SELECT count(*) FROM metering.gpu_samples") == 19 * 8
        assert await pool.fetchval("SELECT count(DISTINCT node) FROM metering.gpu_samples") == 19
        dead = await pool.fetch("SELECT reason, deliveries FROM metering.dead_letters")
        assert [(r["reason"], r["deliveries"]) for r in dead] == [("Unstorable", 1)]
        assert runtime.counters.retried == 0
    finally:
        await runtime.stop()
        await pool.close()
