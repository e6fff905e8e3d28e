"""Admission's ETAs on real NATS + Postgres: a range stored and published with JobPending, refreshed on the
platform clock (a frozen clock refreshes once; moving it on refreshes again), and the production ETA code."""

from __future__ import annotations

import json

import asyncpg
import nats
import pytest

from services.admission import app as admission_app
from services.admission.app import AdmissionService
from services.eta.platform import PlatformEta
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.events import JobPending
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_service import queues, submitted, until
from tests.support.cluster import record_nodes
from tests.unit.telemetry.telemetry_builders import node


# The replay in a forked child (the default where the platform forks) and in a worker thread give the same ETAs.
@pytest.mark.parametrize("in_fork", [True, False], ids=["forked-replay", "thread-replay"])
async def test_waiting_job_gets_an_eta_range_stored_and_published_on_platform_time(
        fresh: tuple[str, str], in_fork: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission_app, "ETA_IN_FORK", in_fork)
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    eta = PlatformEta()
    refreshes: list[float] = []

    class Counting(PlatformEta):
        # every refresh ends with remember in the service's process, whether its replay ran in a forked child or
        # in a worker thread (the platform clock does not move meanwhile: the test moves it)
        def remember(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            refreshes.append(clock.now())
            return super().remember(*args, **kwargs)

    counting = Counting(eta.model)
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8)), eta=counting, eta_interval_s=0.05).spec(),
                         nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)

    async def row(job_id: str) -> asyncpg.Record | None:
        return await conn.fetchrow("SELECT status, eta, eta_low, eta_high FROM admission.jobs WHERE job_id = $1",
                                   job_id)

    await svc.start()
    try:
        await record_nodes(pool, (node("h0"),))  # the scheduler's fact: ETAs read its read model
        await js.publish(ns_subject("job.submitted.team-a"), submitted("first", 8))  # admitted: holds the quota

        async def admitted() -> bool:
            r = await row("first")
            return r is not None and r["status"] == "admitted"

        await until(admitted)
        await until(lambda: _true(bool(refreshes)))  # the first refresh (nothing given before)
        seen = len(refreshes)
        await js.publish(ns_subject("job.submitted.team-a"), submitted("second", 8))

        async def pending() -> bool:
            r = await row("second")
            return r is not None and r["status"] == "pending"

        await until(pending)
        # A change, but the platform clock has not moved: no refresh yet (never paced by wall seconds).
        assert len(refreshes) == seen and (await row("second"))["eta"] is None  # type: ignore[index]
        clock.advance(60.0)

        async def has_eta() -> bool:
            r = await row("second")
            return r is not None and r["eta"] is not None

        await until(has_eta)
        r = await row("second")
        assert r is not None
        # "first" is admitted but not yet placed: it starts now in the replay and holds the node for its limit
        # (no history yet: the prediction is the limit), then "second" starts.
        assert r["eta"] == clock.now() + 86_400  # the default max_runtime_s of a JobSpec
        assert r["eta_low"] <= r["eta"] <= r["eta_high"]
        events = [json.loads(bytes(x["body"])) for x in await conn.fetch("SELECT body FROM admission.outbox")]
        published = [e["data"] for e in events
                     if e["type"] == JobPending.event_type() and e["data"]["job_id"] == "second" and e["data"]["eta"]]
        assert published and published[-1]["eta_low"] is not None and published[-1]["eta_high"] is not None
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _true(value: bool) -> bool:
    return value


async def test_a_preempted_job_is_reported_to_the_eta_for_its_cool_down(fresh: tuple[str, str]) -> None:
    """JobPreempted of an admitted job requeues it, and the ETA hears when (its replays give it the preemptor's
    cool-down); a preemption of a job admission does not hold reports nothing."""
    from datetime import UTC, datetime

    from shared.events import JobPreempted, PreemptionReason, encode_event, make_event
    from tests.service.admission.test_admission_service import _connected

    nats_url, database_url = fresh
    clock = ManualClock()
    reported: list[tuple[str, float]] = []

    class Recording(PlatformEta):
        def job_preempted(self, job_id: str, at: float) -> None:
            reported.append((job_id, at))
            super().job_preempted(job_id, at)

    def preempted(job_id: str) -> bytes:
        now = datetime.fromtimestamp(clock.now(), UTC)
        return encode_event(make_event(JobPreempted(
            job_id=job_id, reason=PreemptionReason.PRIORITY, preemption_id=f"p-{job_id}",
            checkpoint_uri=f"s3://ckpt/{job_id}/1", preempted_at=now), source="test", time=now))

    async with _connected(nats_url, database_url) as (pool, conn, js):
        svc = ServiceRuntime(AdmissionService(parse_queues(queues(8)), eta=Recording()).spec(), nats_url=nats_url,
                             pool=pool, clock=clock, database_url=database_url)
        await svc.start()
        try:
            await js.publish(ns_subject("job.submitted.team-a"), submitted("j1", 8))
            await until(lambda: _status(conn, "j1", "admitted"))
            await js.publish(ns_subject("job.preempted"), preempted("j1"))
            await until(lambda: _true(bool(reported)))  # (requeued, then admitted again at once: the quota is free)
            assert reported == [("j1", clock.now())]
            # The ETA hears of it inside the handler, before its transaction commits: wait for the committed row.
            await until(lambda: _resume_from(conn, "j1", "s3://ckpt/j1/1"))
            await js.publish(ns_subject("job.preempted"), preempted("unknown"))
            await js.publish(ns_subject("job.submitted.team-a"), submitted("j2", 8))
            await until(lambda: _status(conn, "j2", "pending"))  # handled after the second preemption
            assert reported == [("j1", clock.now())]
        finally:
            await svc.stop()


async def _status(conn: asyncpg.Connection, job_id: str, expected: str) -> bool:
    return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id) == expected


async def _resume_from(conn: asyncpg.Connection, job_id: str, expected: str) -> bool:
    return await conn.fetchval("SELECT resume_from FROM admission.jobs WHERE job_id = $1", job_id) == expected
