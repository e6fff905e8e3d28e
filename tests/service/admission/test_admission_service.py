"""The admission service on real NATS + Postgres: a runtime quota change admits waiting work without losing any
job; an invalid change is refused, audited, and the old configuration keeps running; a restart keeps it all."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import nats

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, QueueConfigChanged, encode_event, make_event
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def queues(nominal: int) -> dict:
    return {"priority_classes": [{"name": "normal", "value": 100}],
            "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100": {"nominal": nominal}}}]}


def submitted(job_id: str, gpus: int) -> bytes:
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))


async def until(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_runtime_config_change_and_refusal_survive_restart(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    def runtime() -> ServiceRuntime:
        return ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                              clock=ManualClock(), database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    svc = runtime()
    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish("gpuq.job.submitted", submitted(job_id, 8))
        await until(lambda: _eq(status("j2"), "pending"))
        assert await status("j1") == "admitted"
        row = await conn.fetchrow("SELECT reason, message FROM admission.jobs WHERE job_id = 'j2'")
        assert row["reason"] == "WaitingForQuota" and "8/8" in row["message"]

        bad = queues(16)
        bad["queues"][0]["quotas"]["H100"]["nominal"] = -1
        for doc in (bad, queues(16)):
            await js.publish("gpuq.queue.config_changed", encode_event(make_event(
                QueueConfigChanged(config=doc, changed_by="alice"), source="test", time=T0)))
        await until(lambda: _eq(status("j2"), "admitted"))
        actions = [r["action"] for r in await conn.fetch("SELECT action FROM admission.audit ORDER BY id")]
        assert actions == ["config_refused", "config_applied"]
        refused = await conn.fetchval("SELECT detail->>'error' FROM admission.audit WHERE action = 'config_refused'")
        assert "queues[0].quotas.H100.nominal" in refused
    finally:
        await svc.stop()

    # Restart: the applied configuration (16 GPUs) is the one in force, and nothing was lost.
    svc = runtime()
    await svc.start()
    try:
        await js.publish("gpuq.job.submitted", submitted("j3", 8))
        await until(lambda: _eq(status("j3"), "pending"))
        assert {r["job_id"]: r["status"] for r in await conn.fetch("SELECT job_id, status FROM admission.jobs")} == {
            "j1": "admitted", "j2": "admitted", "j3": "pending"}
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _eq(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return (await value) == expected
