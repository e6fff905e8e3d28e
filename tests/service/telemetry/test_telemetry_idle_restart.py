"""Idle clocks survive a restart of telemetry (issue 48), on real NATS + Postgres with admission and the scheduler:
a notebook idle for 8 of its class's 10 minutes when telemetry restarts is warned 2 minutes later, not 10; telemetry
restarted again during the grace reclaims it when the grace ends, without warning it a second time. (Fails on the
code before, and with the clocks not loaded at start: each restart started the clock again, so the warning came 10
minutes after the restart and the reclaim never within the test.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.scheduler.app import SchedulerService
from services.telemetry.app import TelemetryService
from services.telemetry.webhooks import store as webhooks
from shared.clock import ManualClock
from shared.config import QueuesConfig, parse_queues
from shared.db import create_pool
from shared.domain import CheckpointSpec, JobKind, JobSpec, NodeSpec, PodSet
from shared.events import (
    AuditRecorded,
    GpuSample,
    JobIdleWarned,
    JobStarted,
    JobSubmitted,
    NodeInventory,
    Payload,
    PreemptionReason,
    PreemptionRequested,
    UtilizationSampled,
    make_event,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime, default_subject, publish_event

MODEL = "H100-80GB"
QUEUES = {"priority_classes": [{"name": "normal", "value": 100}],
          "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {MODEL: {"nominal": 8}}}],
          "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
          "job_classes": {"notebook": {"idle": {"threshold_pct": 5, "idle_for_s": 600, "grace_s": 300}}}}


async def until(check: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def telemetry(pool: asyncpg.Pool, nats_url: str, database_url: str, clock: ManualClock,
              config: QueuesConfig) -> ServiceRuntime:
    svc = TelemetryService(metrics_port=None, queues=config, clock=clock, webhook_worker=False)
    return ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)


async def test_a_restart_keeps_the_idle_clock_and_the_warning(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    config = parse_queues(QUEUES)
    others = [ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)
              for spec in (SchedulerService().spec(), AdmissionService(config).spec())]
    tele = telemetry(pool, nats_url, database_url, clock, config)

    async def send(payload: Payload, subject: str | None = None) -> None:
        await publish_event(js, make_event(payload, source="test", time=utcnow_from(clock.now())),
                            subject or default_subject(payload))

    async def emitted(payload_type: type[Payload]) -> list[dict[str, Any]]:
        rows = await conn.fetch("SELECT body FROM telemetry.outbox ORDER BY seq")
        events = [json.loads(bytes(r["body"])) for r in rows]
        return [e["data"] for e in events if e["type"] == payload_type.event_type()]

    async def sample_minutes(minutes: int) -> None:
        for _ in range(minutes):
            clock.advance(60)
            at = clock.now()
            await send(UtilizationSampled(node="n-0", gpu_model=MODEL, sampled_at=utcnow_from(at), interval_s=60,
                                          source="dcgm", samples=tuple(GpuSample(job_id="nb", gpu_index=i,
                                                                                 utilization_pct=1.0)
                                                                       for i in range(8))))
            await until(lambda at=at: conn.fetchval(  # type: ignore[misc]
                "SELECT (doc->>'sampled_at')::float8 >= $1 FROM telemetry.samples WHERE node = 'n-0'", at))

    async def restart() -> ServiceRuntime:
        await tele.stop()
        fresh_tele = telemetry(pool, nats_url, database_url, clock, config)
        await fresh_tele.start()
        return fresh_tele

    for rt in [*others, tele]:
        await rt.start()
    try:
        sub = await webhooks.add_subscription(conn, "https://hooks.example.com/a", "team-a", ["job.idle_warned"])
        await send(NodeInventory(nodes=(NodeSpec(name="n-0", gpus=8, gpu_model=MODEL, cpu_milli=96000,
                                                 memory_mib=1 << 20, rack="r-0", block="b-0"),)))
        spec = JobSpec(job_id="nb", team="team-a", queue="team-a", kind=JobKind.NOTEBOOK, user="alice",
                       priority_class="normal", pod_sets=(PodSet(count=1, gpus_per_pod=8, gpu_models=(MODEL,)),),
                       checkpoint=CheckpointSpec(supported=True, interval_s=3600))
        await send(JobSubmitted(spec=spec, submitted_at=utcnow_from(clock.now())), ns_subject("job.submitted.team-a"))
        await until(lambda: conn.fetchval("SELECT doc->>'phase' = 'placed' FROM telemetry.jobs WHERE job_id = 'nb'"))
        start = clock.now()
        await send(JobStarted(job_id="nb", started_at=utcnow_from(start)))
        await until(lambda: conn.fetchval("SELECT doc->>'phase' = 'running' FROM telemetry.jobs WHERE job_id = 'nb'"))

        await sample_minutes(8)  # idle since the first sample (start + 60): 420 s
        await until(lambda: conn.fetchval("SELECT (doc->>'idle_since')::float8 = $1 FROM telemetry.idle_clocks "
                                          "WHERE job_id = 'nb'", start + 60))
        tele = await restart()

        async def warned() -> int:
            return int(await conn.fetchval("SELECT count(*) FROM telemetry.webhook_deliveries WHERE "
                                           "subscription_id = $1 AND event_type = $2", sub.id,
                                           "io.gpuq.job.idle_warned.v1"))

        await sample_minutes(3)  # start + 660: idle 600 s, counted across the restart
        await until(lambda: _is(warned, 1))
        [delivery] = await conn.fetch("SELECT body FROM telemetry.webhook_deliveries WHERE subscription_id = $1",
                                      sub.id)
        data = json.loads(bytes(delivery["body"]))["data"]
        assert data["job_id"] == "nb" and "600s" in data["message"], data
        assert not await emitted(PreemptionRequested)
        # the same warning on the bus, for the Kubernetes executor's Event (tests/service/kube/test_kube_idle_event.py)
        [fact] = await emitted(JobIdleWarned)
        assert fact["job_id"] == "nb" and fact["message"] == data["message"]

        tele = await restart()  # during the grace (deadline start + 960)
        await sample_minutes(5)
        await until(lambda: emitted(PreemptionRequested))
        [asked] = await emitted(PreemptionRequested)
        assert asked["candidates"] == ["nb"] and asked["reason"] == PreemptionReason.IDLE.value
        assert await warned() == 1 and len(await emitted(JobIdleWarned)) == 1  # not forgotten (and given again)
        audits = [a["action"] for a in await emitted(AuditRecorded) if a["job_id"] == "nb"]
        assert audits.count("idle_warn") == 1 and audits.count("idle_reclaim") == 1, audits
    finally:
        for rt in [tele, *reversed(others)]:
            await rt.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _is(f: Callable[[], Awaitable[int]], expected: int) -> bool:
    return await f() == expected
