"""Admission and a failed attempt its retry policy retries (JobAttemptFailed), on real NATS + Postgres: the quota is
free at once, the job waits pending (BackoffAfterFailure) until its retry time, across a restart, and a second
copy of the event (a producer's retry under a new id) changes nothing."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import nats

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.events import JobAttemptFailed, JobCompleted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_service import _eq, queues, submitted, until

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_a_retried_attempt_frees_its_quota_and_waits_out_its_backoff(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()

    def runtime() -> ServiceRuntime:
        return ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                              clock=clock, database_url=database_url)

    async def row(job_id: str) -> asyncpg.Record:
        return await conn.fetchrow("SELECT status, reason, message, retry_not_before FROM admission.jobs "
                                   "WHERE job_id = $1", job_id)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    async def reason(job_id: str) -> str | None:
        return await conn.fetchval("SELECT reason FROM admission.jobs WHERE job_id = $1", job_id)

    failed_at = datetime.fromtimestamp(clock.now(), UTC)
    not_before = datetime.fromtimestamp(clock.now() + 600, UTC)
    attempt = JobAttemptFailed(job_id="j1", attempt=1, attempts_allowed=3, exit_reason="Error", message="exit 1",
                               finished_at=failed_at, retry_not_before=not_before)
    svc = runtime()
    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))
        await until(lambda: _eq(status("j2"), "pending"))
        assert await status("j1") == "admitted"
        for _ in range(2):  # the second copy has a new event id: the inbox does not know it, the job's status does
            await js.publish(ns_subject("job.attempt_failed"),
                             encode_event(make_event(attempt, source="test", time=failed_at)))
        await until(lambda: _eq(status("j2"), "admitted"))  # j1's quota was released at once
        r = await row("j1")
        assert r["status"] == "pending" and r["reason"] == "BackoffAfterFailure"
        assert "attempt 1 of 3 failed (Error: exit 1)" in r["message"]
        assert r["retry_not_before"] == not_before.timestamp()
    finally:
        await svc.stop()

    svc = runtime()  # a restart during the backoff keeps it
    await svc.start()
    try:
        clock.advance(599)
        await asyncio.sleep(1.0)  # several looks of the backoff timer: not due yet
        assert (await row("j1"))["reason"] == "BackoffAfterFailure"
        clock.advance(1)  # the backoff ends: j1 is back in its queue, behind j2's use of the quota
        await until(lambda: _eq(reason("j1"), "WaitingForQuota"))
        assert (await row("j1"))["retry_not_before"] is None
        await js.publish(ns_subject("job.completed"), encode_event(make_event(
            JobCompleted(job_id="j2", finished_at=T0), source="test", time=T0)))
        await until(lambda: _eq(status("j1"), "admitted"))
        requeued = await _count(nats_url, "job.requeued")
        assert requeued == 1
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _count(nats_url: str, subject: str) -> int:
    from tests.system.test_reclaim_scenario import events_on

    return len(await events_on(nats_url, ns_subject(subject)))


async def test_a_job_cancelled_during_its_backoff_ends_and_is_never_admitted_again(fresh: tuple[str, str]) -> None:
    from shared.events import JobCancelRequested

    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                         clock=clock, database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    async def reason(job_id: str) -> str | None:
        return await conn.fetchval("SELECT reason FROM admission.jobs WHERE job_id = $1", job_id)

    now = datetime.fromtimestamp(clock.now(), UTC)
    await svc.start()
    try:
        await js.publish(ns_subject("job.submitted.team-a"), submitted("j1", 8))
        await until(lambda: _eq(status("j1"), "admitted"))
        await js.publish(ns_subject("job.attempt_failed"), encode_event(make_event(JobAttemptFailed(
            job_id="j1", attempt=1, attempts_allowed=2, exit_reason="NodeFailure", finished_at=now,
            retry_not_before=datetime.fromtimestamp(clock.now() + 60, UTC)), source="test", time=now)))
        await until(lambda: _eq(reason("j1"), "BackoffAfterFailure"))
        await js.publish(ns_subject("job.cancel_requested.team-a"), encode_event(make_event(
            JobCancelRequested(job_id="j1"), source="test", time=now)))
        await until(lambda: _eq(status("j1"), "finished"))
        clock.advance(120)  # past the backoff: nothing wakes
        await asyncio.sleep(1.0)
        row = await conn.fetchrow("SELECT status, outcome, retry_not_before FROM admission.jobs WHERE job_id = 'j1'")
        assert (row["status"], row["outcome"], row["retry_not_before"]) == ("finished", "Cancelled", None)
        assert await _count(nats_url, "job.admitted") == 1
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_preemption_that_crossed_the_jobs_end_does_not_run_it_again(fresh: tuple[str, str]) -> None:
    """JobPreempted and JobCompleted come from different services: the job may end while its checkpoint is taken,
    and the preemption reach admission after the end. The finished job stays finished, nothing is requeued, and the
    job that took its quota keeps it."""
    from shared.events import JobPreempted, PreemptionReason

    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                         clock=clock, database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    now = datetime.fromtimestamp(clock.now(), UTC)
    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))
        await until(lambda: _eq(status("j2"), "pending"))
        await js.publish(ns_subject("job.completed"), encode_event(make_event(
            JobCompleted(job_id="j1", finished_at=now), source="test", time=now)))
        await until(lambda: _eq(status("j2"), "admitted"))
        await js.publish(ns_subject("job.preempted"), encode_event(make_event(JobPreempted(
            job_id="j1", reason=PreemptionReason.PRIORITY, preemption_id="p1", checkpoint_uri="s3://ckpt/j1/1",
            preempted_at=now), source="test", time=now)))
        # a later event on the same consumer: once j3 is seen, the preemption before it was handled
        await js.publish(ns_subject("job.submitted.team-a"), submitted("j3", 8))
        await until(lambda: _eq(status("j3"), "pending"))
        assert await status("j1") == "finished"
        assert await status("j2") == "admitted"
        assert await conn.fetchval("SELECT resume_from FROM admission.jobs WHERE job_id = 'j1'") is None
        assert await _count(nats_url, "job.requeued") == 0
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()
