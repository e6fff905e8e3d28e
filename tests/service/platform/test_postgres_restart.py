"""A Postgres restart under running services: the singletons lose their leases, take them again, and jobs move
again; /readyz says "recovering" meanwhile. The test runs its own Postgres (a scratch cluster) so that it can
restart it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio

from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.servers import ScratchPostgres
from shared.service import publish_event
from tests.conftest import reset_bus

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576},
]})
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 16}}}],
})


@pytest_asyncio.fixture
async def own_postgres(tmp_path: Path) -> AsyncIterator[ScratchPostgres]:
    server = ScratchPostgres(tmp_path / "pg")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop, "immediate")


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def placed(url: str, job_ids: list[str]) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (OSError, asyncpg.PostgresError):
        return False
    try:
        n = await conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE job_id = ANY($1::text[]) "
                                "AND status IN ('placed', 'finished')", job_ids)
    except asyncpg.PostgresError:
        return False
    finally:
        await conn.close()
    return bool(n == len(job_ids))


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=1),),
                   max_runtime_s=4000, labels={"sim.gpuq.io/duration-s": "2000"})


async def submit(nats_url: str, job_ids: list[str]) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for job_id in job_ids:
            event = make_event(JobSubmitted(spec=spec(job_id), submitted_at=datetime.now(UTC)), source="test",
                               time=datetime.now(UTC))
            await publish_event(js, event, ns_subject("job.submitted.team-a"))
    finally:
        await nc.close()


@pytest.mark.timeout(300)
async def test_jobs_move_again_after_a_postgres_restart(nats_url: str, own_postgres: ScratchPostgres) -> None:
    await reset_bus(nats_url)
    database_url = own_postgres.url
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "executor"), clock=ScaledClock(10.0))
    async with Stack(settings) as stack:
        before = [f"before-{i}" for i in range(3)]
        await submit(nats_url, before)
        await eventually(lambda: placed(database_url, before), "the first jobs to be placed")

        await asyncio.to_thread(own_postgres.stop, "fast")  # every session, lease connections included, is cut

        async def recovering() -> bool:
            report = await stack.health()
            phases = {report.services[name].phase for name in ("admission", "scheduler")}
            return phases == {"recovering"} and not report.ready and report.live

        await eventually(recovering, "/readyz to report the lost lease")
        lease_check = (await stack.health()).services["scheduler"].checks["lease"]
        assert not lease_check.ok and "recovering" in lease_check.detail
        await asyncio.to_thread(own_postgres.start)

        async def ready() -> bool:
            return (await stack.health()).ready

        await eventually(ready, "readiness after Postgres came back", timeout=90)
        after = [f"after-{i}" for i in range(3)]
        await submit(nats_url, after)
        await eventually(lambda: placed(database_url, after), "jobs submitted after the restart to be placed",
                         timeout=90)
        for name in ("admission", "scheduler"):
            runtime = stack.runtime(name)
            assert runtime.recoveries >= 1 and runtime.phase == "running"
        # a new term: the scheduler's fence moved on with the lease
        conn = await asyncpg.connect(database_url)
        try:
            term = await conn.fetchval("SELECT term FROM scheduler.leader_terms WHERE scope = 'scheduler'")
        finally:
            await conn.close()
        assert term >= 2 and stack.runtime("scheduler").lease.term == term  # type: ignore[union-attr]  # a singleton
