"""Opting out of preemption is not free, on the real service (NATS + Postgres): a job that asks not to be preempted
in a class that does not allow it waits for an admin's approval, and once approved (or in a class that allows it)
it still never borrows: it waits for its own queue's nominal quota (issue 43 item 5)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobApproved, JobSubmitted, Payload, encode_event, make_event
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUEUES: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100},
                         {"name": "pinned", "value": 100, "allow_non_preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": q, "cohort": "research", "teams": [q], "quotas": {"H100": {"nominal": n}}}
               for q, n in (("team-a", 8), ("team-b", 4))],
}


def spec(job_id: str, gpus: int, priority_class: str = "normal", preemptible: bool | None = None) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-b", queue="team-b", priority_class=priority_class,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus),), preemptible=preemptible)


async def until(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_an_opt_out_waits_for_approval_and_never_borrows(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    runtime = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                             clock=ManualClock(), database_url=database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def publish(payload: Payload, subject: str) -> None:
        await js.publish(subject, encode_event(make_event(payload, source="test", time=T0)))

    async def row(job_id: str) -> asyncpg.Record | None:
        return await pool.fetchrow("SELECT status, approval, reason, message, borrowing FROM admission.jobs "
                                   "WHERE job_id = $1", job_id)

    submit = JobSubmitted.scoped_subject("team-b")
    await runtime.start()
    try:
        # team-a is idle: 8 GPUs to lend. The opt-out in a preemptible class waits for an admin.
        await publish(JobSubmitted(spec=spec("b-optout", 2, preemptible=False)), submit)
        await until(lambda: _has(row("b-optout")))
        r = await row("b-optout")
        assert r is not None
        assert (r["status"], r["approval"], r["reason"]) == ("pending", "required", "AwaitingApproval")
        assert "preemptible: false" in r["message"] and "gpuq approve b-optout" in r["message"]
        # A class that allows it needs no approval, and takes team-b's nominal 4 without borrowing.
        await publish(JobSubmitted(spec=spec("b-allowed", 4, "pinned", preemptible=False)), submit)
        await until(lambda: _status(row("b-allowed"), "admitted"))
        assert (await row("b-allowed"))["borrowing"] is False  # type: ignore[index]
        # A preemptible job of team-b borrows team-a's idle GPUs, the approved opt-out does not.
        await publish(JobSubmitted(spec=spec("b-free", 2)), submit)
        await until(lambda: _status(row("b-free"), "admitted"))
        assert (await row("b-free"))["borrowing"] is True  # type: ignore[index]
        await publish(JobApproved(job_id="b-optout", approved_by="ops"), JobApproved.subject())
        await until(lambda: _reason(row("b-optout"), "WaitingForQuota"))
        r = await row("b-optout")
        assert r is not None and (r["status"], r["approval"]) == ("pending", "approved")
        assert "not preemptible, so it never borrows" in r["message"]
    finally:
        await runtime.stop()
        await nc.close()
        await pool.close()


async def _has(row: Any) -> bool:
    return (await row) is not None


async def _status(row: Any, status: str) -> bool:
    r = await row
    return r is not None and r["status"] == status


async def _reason(row: Any, reason: str) -> bool:
    r = await row
    return r is not None and r["reason"] == reason
