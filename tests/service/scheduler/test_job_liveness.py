"""A job whose pods never report is failed as Lost by the scheduler's liveness watch, and its quota and GPUs are
released exactly once: the job waiting for that quota starts, the one behind it still waits, and a job the
executor keeps listing in its heartbeats is left alone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import asyncpg
import nats
import pytest

from services.executor.sim import SILENT_LABEL
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576},
]})
# Quota for the silent 8-GPU job and the 1-GPU one: each 8-GPU job behind them waits for quota.
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 9}}}],
})


def spec(job_id: str, gpus: int, **labels: str) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),),
                   max_runtime_s=200_000, labels={"sim.gpuq.io/duration-s": "100000", **labels})


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


@pytest.mark.timeout(180)
async def test_a_silent_job_is_lost_and_releases_its_quota_and_gpus_once(
        fresh: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    nats_url, database_url = fresh
    monkeypatch.setenv("GPUQ_HEARTBEAT_INTERVAL_S", "0.5")
    monkeypatch.setenv("GPUQ_HEARTBEAT_TIMEOUT_S", "4")
    monkeypatch.setenv("GPUQ_LIVENESS_CHECK_S", "0.5")
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor"), clock=ScaledClock(10.0))
    async with Stack(settings) as stack:
        conn = await asyncpg.connect(database_url)
        nc = await nats.connect(nats_url)
        try:
            async def submit(job: JobSpec) -> None:
                event = make_event(JobSubmitted(spec=job, submitted_at=datetime.now(UTC)), source="test",
                                   time=datetime.now(UTC))
                await publish_event(nc.jetstream(), event, ns_subject("job.submitted.team-a"))

            async def status(job_id: str) -> tuple[str | None, str | None]:
                row = await conn.fetchrow("SELECT status, outcome FROM admission.jobs WHERE job_id = $1", job_id)
                return (row["status"], row["outcome"]) if row is not None else (None, None)

            async def running(job_id: str) -> bool:
                return bool(await conn.fetchval(
                    "SELECT count(*) FROM executor.runs WHERE job_id = $1 AND status = 'running'", job_id))

            await submit(spec("silent", 8, **{SILENT_LABEL: "true"}))
            await submit(spec("alive", 1))
            for job_id in ("silent", "alive"):
                await eventually(lambda job_id=job_id: running(job_id), f"{job_id} to run")  # type: ignore[misc]  # bound per loop turn
            await submit(spec("waiter", 8))
            await submit(spec("behind", 8))

            async def silent_lost() -> bool:
                return await status("silent") == ("finished", "Lost")

            await eventually(silent_lost, "the silent job to be failed as Lost")
            await eventually(lambda: running("waiter"), "the job waiting for its quota to run")
            assert stack.runtime("scheduler").phase == "running"
            # Lost once: one JobFailed(Lost) for it; the executor stopped the run; the other jobs were left alone.
            assert await conn.fetchval("SELECT count(*) FROM scheduler.outbox WHERE convert_from(body, 'UTF8') "
                                       "LIKE '%\"exit_reason\":\"Lost\"%'") == 1
            assert await conn.fetchval("SELECT outcome FROM executor.runs WHERE job_id = 'silent'") == "Lost"
            assert await conn.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'silent'") == "finished"
            await asyncio.sleep(3.0)  # a few more liveness checks and heartbeats: nothing else may be declared lost
            assert await status("alive") == ("admitted", None) and await running("alive")
            # Released exactly once: the quota freed admits one 8-GPU job, not two.
            assert (await status("behind"))[0] == "pending"
        finally:
            await nc.close()
            await conn.close()
