"""Idle reclaim on real NATS + Postgres (issue 48): admission, scheduler, preemption and telemetry together. A
notebook whose GPUs DCGM reports below its class's threshold for `idle_for_s` gets a `job.idle_warned` webhook
(queued for the team's subscription) and an audit record; after the grace, telemetry asks the preemption service
(reason IdleReclaim) to checkpoint and requeue it, and admission requeues it with its checkpoint. A production
notebook just as idle is warned but never preempted, and a busy notebook is left alone. (Fails on the code before:
nothing acts on idleness.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.preemption.app import PreemptionService
from services.scheduler.app import SchedulerService
from services.telemetry.app import TelemetryService
from services.telemetry.webhooks import store as webhooks
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import CheckpointSpec, JobKind, JobSpec, NodeSpec, PodSet
from shared.events import (
    AuditRecorded,
    CheckpointRequested,
    GpuSample,
    JobCancelRequested,
    JobCheckpointed,
    JobPreempted,
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
QUEUES = {"priority_classes": [{"name": "production", "value": 1000, "preemptible": False},
                               {"name": "normal", "value": 100}],
          "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {MODEL: {"nominal": 32}}}],
          "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
          "job_classes": {"notebook": {"idle": {"threshold_pct": 5, "idle_for_s": 600, "grace_s": 300}},
                          "inference": {"idle": {"threshold_pct": 5, "idle_for_s": 600, "grace_s": 300,
                                                 "action": "end"}}}}
# job -> (node, its utilisation)
JOBS = {"nb-idle": ("n-0", 1.0), "nb-prod": ("n-1", 0.0), "nb-busy": ("n-2", 60.0), "inf-end": ("n-3", 0.5)}


def notebook(job_id: str) -> JobSpec:
    kind = JobKind.INFERENCE if job_id == "inf-end" else JobKind.NOTEBOOK  # its class ends it
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", kind=kind, user="alice",
                   priority_class="production" if job_id == "nb-prod" else "normal",
                   pod_sets=(PodSet(count=1, gpus_per_pod=8, gpu_models=(MODEL,)),),
                   checkpoint=CheckpointSpec(supported=True, interval_s=3600))


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_an_idle_notebook_is_warned_then_checkpointed_and_requeued(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    config = parse_queues(QUEUES)
    runtimes = [ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)
                for spec in (SchedulerService().spec(), PreemptionService(config, tick_s=0.05).spec(),
                             TelemetryService(metrics_port=None, queues=config, clock=clock,
                                              webhook_worker=False).spec(),
                             AdmissionService(config).spec())]

    async def send(payload: Payload, subject: str | None = None) -> None:
        await publish_event(js, make_event(payload, source="test", time=utcnow_from(clock.now())),
                            subject or default_subject(payload))

    async def emitted(schema: str, payload_type: type[Payload]) -> list[dict[str, Any]]:
        rows = await conn.fetch(f"SELECT body FROM {schema}.outbox ORDER BY seq")
        events = [json.loads(bytes(r["body"])) for r in rows]
        return [e["data"] for e in events if e["type"] == payload_type.event_type()]

    async def sampled_since(at: float) -> bool:
        return bool(await conn.fetchval(
            "SELECT count(*) = 4 FROM telemetry.samples WHERE (doc->>'sampled_at')::float8 >= $1", at))

    async def placed(job_id: str) -> bool:
        return bool(await conn.fetchval("SELECT doc->>'phase' = 'placed' FROM telemetry.jobs WHERE job_id = $1",
                                        job_id))

    async def sample_minutes(minutes: int) -> None:
        """Each minute of platform time, DCGM's samples of every job's GPUs (telemetry consumed them before the
        clock moves on)."""
        for _ in range(minutes):
            clock.advance(60)
            for job_id, (node, util) in JOBS.items():
                await send(UtilizationSampled(node=node, gpu_model=MODEL, sampled_at=utcnow_from(clock.now()),
                                              interval_s=60, source="dcgm",
                                              samples=tuple(GpuSample(job_id=job_id, gpu_index=i, utilization_pct=util)
                                                            for i in range(8))))
            await until(lambda: sampled_since(clock.now()))

    for rt in runtimes:
        await rt.start()
    try:
        sub = await webhooks.add_subscription(conn, "https://hooks.example.com/a", "team-a", ["job.idle_warned"])
        await send(NodeInventory(nodes=tuple(NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000,
                                                      memory_mib=1 << 20, rack="r-0", block="b-0")
                                             for i in range(4))))
        for job_id in JOBS:
            await send(JobSubmitted(spec=notebook(job_id), submitted_at=utcnow_from(clock.now())),
                       ns_subject("job.submitted.team-a"))
            # telemetry heard of its placement (the scheduler's JobPlaced) before the executor's start
            await until(lambda: placed(job_id))  # noqa: B023 (awaited within the iteration)
            await send(JobStarted(job_id=job_id, started_at=utcnow_from(clock.now())))
        await until(lambda: conn.fetchval("SELECT count(*) = 4 FROM telemetry.jobs WHERE doc->>'phase' = 'running'"))

        await sample_minutes(11)  # idle since the first sample: 600 s at the 11th

        async def warned() -> list[str]:
            rows = await conn.fetch("SELECT body FROM telemetry.webhook_deliveries WHERE subscription_id = $1 "
                                    "AND event_type = $2 ORDER BY id", sub.id, "io.gpuq.job.idle_warned.v1")
            return [json.loads(bytes(r["body"]))["data"]["job_id"] for r in rows]

        await until(lambda: _equal(warned, ["inf-end", "nb-idle", "nb-prod"]))
        audits = [a for a in await emitted("telemetry", AuditRecorded) if a["action"] == "idle_warn"]
        assert sorted(a["job_id"] for a in audits) == ["inf-end", "nb-idle", "nb-prod"]
        assert not await emitted("telemetry", PreemptionRequested)  # nothing reclaimed during the grace

        await sample_minutes(6)  # the grace (300 s) passes, still idle

        async def checkpoint_asked() -> bool:
            return len(await emitted("preemption", CheckpointRequested)) == 2

        await until(checkpoint_asked)
        asked = await emitted("preemption", CheckpointRequested)
        assert sorted(a["job_id"] for a in asked) == ["inf-end", "nb-idle"]  # production is never preempted
        await until(lambda: conn.fetchval("SELECT true FROM preemption.requests WHERE preemptor = 'idle:nb-prod'"))
        kept = await conn.fetchval("SELECT message FROM preemption.requests WHERE preemptor = 'idle:nb-prod'")
        assert "production" in kept.lower() or "not preemptible" in kept.lower() or "never" in kept.lower(), kept
        for a in asked:
            await send(JobCheckpointed(job_id=a["job_id"], uri=f"s3://ckpt/{a['job_id']}/1", step=3,
                                       checkpointed_at=utcnow_from(clock.now()), preemption_id=a["preemption_id"]))

        async def preempted() -> bool:
            return len(await emitted("preemption", JobPreempted)) == 2

        await until(preempted)
        got = sorted((p["job_id"], p["reason"], p["checkpoint_uri"]) for p in await emitted("preemption", JobPreempted))
        assert got == [("inf-end", PreemptionReason.IDLE.value, "s3://ckpt/inf-end/1"),
                       ("nb-idle", PreemptionReason.IDLE.value, "s3://ckpt/nb-idle/1")]
        # the class that ends its idle jobs: checkpointed, then its cancel asked: it ends Cancelled
        await until(lambda: conn.fetchval("SELECT outcome = 'Cancelled' FROM admission.jobs WHERE job_id = 'inf-end'"))
        assert [c["job_id"] for c in await emitted("telemetry", JobCancelRequested)] == ["inf-end"]
        await until(lambda: conn.fetchval("SELECT resume_from = 's3://ckpt/nb-idle/1' FROM admission.jobs "
                                          "WHERE job_id = 'nb-idle'"))
        reclaims = [a for a in await emitted("telemetry", AuditRecorded) if a["action"] == "idle_reclaim"]
        assert sorted((a["job_id"], a["detail"]["reclaim_by"]) for a in reclaims) == [
            ("inf-end", "end"), ("nb-idle", "requeue"), ("nb-prod", "requeue")]
        assert await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'nb-busy'") == "admitted"
    finally:
        for rt in reversed(runtimes):
            await rt.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _equal(f: Callable[[], Awaitable[list[str]]], expected: list[str]) -> bool:
    return sorted(await f()) == expected
