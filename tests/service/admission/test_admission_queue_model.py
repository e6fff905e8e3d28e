"""Admission's queues read model (services/admission/queuemodel.py, the view admission.v1_queues) on real NATS +
Postgres: what GET /v1/queues and `gpuq queues` read equals the core's summary of admission's state rebuilt from its
tables, with borrowing, lending and pending jobs, and after a configuration change."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats

from services.admission import queuemodel
from services.admission.app import AdmissionService, load_state
from services.core.admission import queue_summaries
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, QueueConfigChanged, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def cohort(extra: bool = False) -> dict[str, Any]:
    """team-a and an idle lender share cohort c (8 H100 each); `extra` adds a third queue."""
    queues = [{"name": "team-a", "teams": ["team-a"], "cohort": "c", "quotas": {"H100": {"nominal": 8}}},
              {"name": "lender", "teams": ["lender"], "cohort": "c", "quotas": {"H100": {"nominal": 8}}}]
    if extra:
        queues.append({"name": "extra", "teams": ["extra"], "quotas": {"H100": {"nominal": 2}}})
    return {"priority_classes": [{"name": "normal", "value": 100}], "cohorts": [{"name": "c"}], "queues": queues}


def submitted(job_id: str, gpus: int, at: datetime) -> bytes:
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=at), source="test", time=at))


async def until(check: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_the_read_model_answers_as_the_core_does_with_borrowing_and_pending_jobs(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = ServiceRuntime(AdmissionService(parse_queues(cohort())).spec(), nats_url=nats_url, pool=pool,
                         clock=ManualClock(), database_url=database_url)

    async def statuses() -> dict[str, str]:
        rows = await conn.fetch("SELECT job_id, status FROM admission.jobs")
        return {r["job_id"]: r["status"] for r in rows}

    async def compare(now: float) -> list[Any]:
        facts = await queuemodel.queues(conn)
        assert facts is not None
        read = [f.at(now) for f in facts]
        assert read == queue_summaries(await load_state(conn), now)  # the core's view of the committed state
        return read

    await svc.start()
    try:
        # j1 fills team-a's 8, j2 borrows the lender's 8, j3 and j4 wait
        for n, gpus in enumerate((8, 8, 8, 4)):
            at = T0.replace(second=n)
            await js.publish(ns_subject("job.submitted.team-a"), submitted(f"j{n + 1}", gpus, at))

        async def settled() -> bool:
            return await statuses() == {"j1": "admitted", "j2": "admitted", "j3": "pending", "j4": "pending"}
        await until(settled)
        oldest = await conn.fetchval("SELECT min(submitted_at) FROM admission.jobs WHERE status = 'pending'")
        now = oldest + 60
        rows = {r.queue: r for r in await compare(now)}
        assert (rows["team-a"].used, rows["team-a"].borrowed, rows["team-a"].pending, rows["team-a"].running) == \
            ({"H100": 16}, {"H100": 8}, 2, 2)
        assert rows["lender"].lent == {"H100": 8}
        assert rows["team-a"].oldest_wait_s == 60.0

        # a change adds a queue: its row appears with the change's commit
        await js.publish(ns_subject("queue.config_changed"), encode_event(make_event(
            QueueConfigChanged(config=cohort(extra=True), changed_by="alice"), source="test", time=T0)))

        async def extra_listed() -> bool:
            facts = await queuemodel.queues(conn)
            return facts is not None and "extra" in {f.queue for f in facts}
        await until(extra_listed)
        assert [r.queue for r in await compare(now)] == ["extra", "lender", "team-a"]
        # and goes with the next one that drops it
        await js.publish(ns_subject("queue.config_changed"), encode_event(make_event(
            QueueConfigChanged(config=cohort(), changed_by="alice"), source="test", time=T0)))
        await until(lambda: _not(extra_listed()))
        assert [r.queue for r in await compare(now)] == ["lender", "team-a"]
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _not(check: Any) -> bool:
    return not await check
