"""Per-team limits on real NATS + Postgres: a team that submits faster than its token bucket, or has too many jobs
waiting, is refused (JobRejected, reason RateLimited / TooManyPending, with what to do) without its job id being
taken, and other teams are not affected. The admission clock is a manual one: the verdicts are the same every
run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
import pytest_asyncio
from nats.js import JetStreamContext

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobCancelRequested, JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def queues(**team_a: Any) -> dict[str, Any]:
    return {"priority_classes": [{"name": "normal", "value": 100}],
            "queues": [{"name": t, "teams": [t], "quotas": {"H100": {"nominal": 1}}} for t in ("team-a", "team-b")],
            "governance": {"teams": {"team-a": team_a}}}


class Platform:
    def __init__(self, js: JetStreamContext, conn: asyncpg.Connection, clock: ManualClock) -> None:
        self.js, self.conn, self.clock = js, conn, clock

    async def submit(self, job_id: str, team: str = "team-a") -> None:
        spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=1),))
        await self.js.publish(ns_subject(f"job.submitted.{team}"), encode_event(make_event(
            JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0)))

    async def cancel(self, job_id: str, team: str = "team-a") -> None:
        await self.js.publish(ns_subject(f"job.cancel_requested.{team}"), encode_event(make_event(
            JobCancelRequested(job_id=job_id), source="test", time=T0)))

    async def verdicts(self, n: int) -> list[tuple[str, str, str | None, str]]:
        """The verdicts, once there are `n` (committed); by admission's clock, which these tests move by hand."""
        for _ in range(300):
            rows = await self.conn.fetch("SELECT job_id, verdict, reason, coalesce(message, '') AS message "
                                         "FROM admission.submissions ORDER BY at, event_id")
            if len(rows) >= n:
                return [(r["job_id"], r["verdict"], r["reason"], r["message"]) for r in rows]
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {n} verdicts")

    async def rejections(self, n: int) -> list[dict[str, Any]]:
        """The JobRejected events on the bus (what a producer or the API hears)."""
        sub = await self.js.pull_subscribe(ns_subject("job.rejected"), stream=None)
        found: list[dict[str, Any]] = []
        for _ in range(100):
            try:
                for msg in await sub.fetch(n - len(found), timeout=0.5):
                    found.append(json.loads(msg.data)["data"])
                    await msg.ack()
            except nats.errors.TimeoutError:
                pass
            if len(found) >= n:
                break
        await sub.unsubscribe()
        return found


@pytest_asyncio.fixture
async def start(fresh: tuple[str, str]) -> AsyncIterator[Callable[..., Awaitable[Platform]]]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    runtimes: list[ServiceRuntime] = []

    async def started(**team_a: Any) -> Platform:
        clock = ManualClock()
        rt = ServiceRuntime(AdmissionService(parse_queues(queues(**team_a))).spec(), nats_url=nats_url, pool=pool,
                            clock=clock, database_url=database_url)
        await rt.start()
        runtimes.append(rt)
        return Platform(nc.jetstream(), conn, clock)

    try:
        yield started
    finally:
        for rt in runtimes:
            await rt.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_team_over_its_submission_rate_is_refused_until_tokens_come_back(
        start: Callable[..., Awaitable[Platform]]) -> None:
    p = await start(submit_rate_per_s=0.5, submit_burst=3)
    for i in range(5):
        await p.submit(f"a{i}")
    await p.submit("b0", team="team-b")
    verdicts = {job: (verdict, reason, message) for job, verdict, reason, message in await p.verdicts(6)}
    assert {j for j, v in verdicts.items() if v[1] != "RateLimited"} == {"a0", "a1", "a2", "b0"}
    verdict, reason, message = verdicts["a4"]
    assert (verdict, reason) == ("rejected", "RateLimited")
    assert "0.5 per second (bursts of 3)" in message and "submit it again in 2.0 s" in message
    # No job row: the id is still the team's to submit again.
    assert await p.conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id IN ('a3', 'a4')") == 0
    told = await p.rejections(2)
    assert sorted((r["job_id"], r["reason"]) for r in told) == [("a3", "RateLimited"), ("a4", "RateLimited")]
    p.clock.advance(2.0)  # one token back
    await p.submit("a3")
    again = [v for v in await p.verdicts(7) if v[0] == "a3"]
    assert [v[1] for v in again] == ["rejected", "queued"]


async def test_a_team_with_too_many_jobs_waiting_is_refused_until_one_leaves(
        start: Callable[..., Awaitable[Platform]]) -> None:
    p = await start(max_pending_jobs=2)
    # One GPU of quota: a0 is admitted, a1 and a2 wait, a3 is one too many. a0's admission is waited for (committed)
    # before the others go: sent together, a2 could arrive before the cycle that admits a0 and be the one refused.
    await p.submit("a0")
    for _ in range(300):
        if await p.conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'a0'") == "admitted":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("a0 was never admitted")
    for i in range(1, 4):
        await p.submit(f"a{i}")
    await p.submit("b0", team="team-b")
    await p.submit("b1", team="team-b")
    verdicts = {job: (verdict, reason, message) for job, verdict, reason, message in await p.verdicts(6)}
    assert verdicts["a3"][:2] == ("rejected", "TooManyPending")
    assert "already has 2 jobs waiting, at most 2" in verdicts["a3"][2]
    assert {j for j, v in verdicts.items() if v[0] == "queued"} == {"a0", "a1", "a2", "b0", "b1"}
    assert await p.conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id = 'a3'") == 0
    assert [r["reason"] for r in await p.rejections(1)] == ["TooManyPending"]
    await p.cancel("a2")
    for _ in range(200):
        if await p.conn.fetchval("SELECT outcome FROM admission.jobs WHERE job_id = 'a2'") == "Cancelled":
            break
        await asyncio.sleep(0.1)
    await p.submit("a3")
    assert sorted(v[1] for v in await p.verdicts(7) if v[0] == "a3") == ["queued", "rejected"]
