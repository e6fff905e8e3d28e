"""Quotas beyond GPUs on the real admission service (NATS + Postgres), issue 48 item 5: a job asking no GPU is
charged its CPU, borrows CPU from its cohort, and the lender's job within its nominal CPU asks for the loan back
(PreemptionRequested, ReclaimQuota); once the borrower is preempted the lender's job is admitted within its
guarantee, and the queues read model shows the CPU quota."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats

from services.admission import queuemodel
from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobPreempted, JobSubmitted, Payload, PreemptionReason, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUEUES: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100}, {"name": "low", "value": 0}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": q, "cohort": "research", "teams": [q],
                "preemption": {"reclaim_within_cohort": "Any"},
                "quotas": {"H100": {"nominal": 8}, "cpu_milli": {"nominal": 4000}}}
               for q in ("team-a", "team-b")]
    + [{"name": "team-c", "teams": ["team-c"], "quotas": {"H100": {"nominal": 8}}}],
}


def cpu_spec(job_id: str, team: str, pods: int, priority_class: str = "normal") -> JobSpec:
    """A job asking no GPU: `pods` pods of one CPU each."""
    return JobSpec(job_id=job_id, team=team, queue=team, priority_class=priority_class,
                   pod_sets=(PodSet(count=pods, gpus_per_pod=0, cpu_milli=1000, memory_mib=512),))


async def until(check: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_cpu_is_charged_borrowed_and_reclaimed_within_the_guarantee(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    runtime = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                             clock=ManualClock(), database_url=database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def publish(payload: Payload, subject: str) -> None:
        await js.publish(subject, encode_event(make_event(payload, source="test", time=T0)))

    async def row(job_id: str) -> asyncpg.Record | None:
        return await pool.fetchrow("SELECT status, reason, usage, borrowing FROM admission.jobs WHERE job_id = $1",
                                   job_id)

    async def status_is(job_id: str, status: str, reason: str | None = None) -> bool:
        r = await row(job_id)
        return r is not None and r["status"] == status and (reason is None or r["reason"] == reason)

    async def reclaims() -> list[dict[str, Any]]:
        rows = await pool.fetch("SELECT body FROM admission.outbox WHERE subject = $1 ORDER BY seq",
                                ns_subject("preemption.requested"))
        return [json.loads(bytes(r["body"]))["data"] for r in rows]

    await runtime.start()
    try:
        # team-a is idle: team-b's 6-CPU job takes its own 4 and borrows 2 of team-a's
        await publish(JobSubmitted(spec=cpu_spec("b-big", "team-b", 6, "low")), JobSubmitted.scoped_subject("team-b"))
        await until(lambda: status_is("b-big", "admitted"))
        r = await row("b-big")
        assert r is not None and json.loads(r["usage"]) == {"cpu_milli": 6000} and r["borrowing"] is True
        # team-a's 3-CPU job is within its nominal 4 but only 2 are free: it asks for its loan back
        await publish(JobSubmitted(spec=cpu_spec("a-own", "team-a", 3)), JobSubmitted.scoped_subject("team-a"))
        await until(lambda: status_is("a-own", "pending", "WaitingForReclaim"))
        [ask] = await reclaims()
        assert (ask["preemptor"], ask["reason"], ask["need"], ask["candidates"]) == \
            ("a-own", "ReclaimQuota", {"cpu_milli": 1000}, ["b-big"])
        async def rows() -> dict[str, Any]:
            return {f.queue: f for f in (await queuemodel.queues(pool) or [])}

        async def lent() -> bool:
            return "team-a" in (f := await rows()) and f["team-a"].lent == {"cpu_milli": 2000}
        await until(lent)
        facts = await rows()
        assert facts["team-b"].nominal == {"H100": 8, "cpu_milli": 4000}
        assert (facts["team-b"].used, facts["team-b"].borrowed) == ({"cpu_milli": 6000}, {"cpu_milli": 2000})
        # the preemption service takes the borrower: team-a's job gets its guaranteed CPU, the borrower waits
        await publish(JobPreempted(job_id="b-big", reason=PreemptionReason.RECLAIM, preemptor="a-own",
                                   preempted_at=T0), JobPreempted.subject())
        await until(lambda: status_is("a-own", "admitted"))
        r = await row("a-own")
        assert r is not None and json.loads(r["usage"]) == {"cpu_milli": 3000} and r["borrowing"] is False
        await until(lambda: status_is("b-big", "pending", "WaitingForBorrowableQuota"))
        # a queue that sets no CPU or memory quota still refuses a job asking for no GPU
        await publish(JobSubmitted(spec=cpu_spec("c-cpu", "team-c", 1)), JobSubmitted.scoped_subject("team-c"))
        await until(lambda: status_is("c-cpu", "rejected", "NoGpuRequested"))
    finally:
        await runtime.stop()
        await nc.close()
        await pool.close()
