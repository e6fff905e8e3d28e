"""Per-user limits on real NATS + Postgres (issue 48): a user past a job class's `max_per_user` (notebooks) or the
team's `per_user` limits is refused at submit, reason UserLimit, without the job id being taken; other users of the
team, jobs with no user and other teams are not affected; a user whose job ended may submit again. (Fails on the
code before: every job was queued.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import nats
import pytest_asyncio

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobKind, JobSpec, PodSet
from shared.events import JobCancelRequested, JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.admission.test_admission_limits import T0, Platform

QUEUES = {"priority_classes": [{"name": "normal", "value": 100}],
          "queues": [{"name": t, "teams": [t], "quotas": {"H100": {"nominal": 16}}} for t in ("team-a", "team-b")],
          "governance": {"teams": {"team-a": {"per_user": {"max_jobs": 3, "max_gpus": 6}}}},
          "job_classes": {"notebook": {"max_per_user": 1}}}


class Users(Platform):
    async def submit_as(self, job_id: str, user: str | None, team: str = "team-a", gpus: int = 1,
                        kind: JobKind = JobKind.TRAINING) -> None:
        spec = JobSpec(job_id=job_id, team=team, queue=team, kind=kind, user=user,
                       pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))
        await self.js.publish(ns_subject(f"job.submitted.{team}"), encode_event(make_event(
            JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0)))

    async def cancel(self, job_id: str, team: str = "team-a") -> None:
        await self.js.publish(ns_subject(f"job.cancel_requested.{team}"), encode_event(make_event(
            JobCancelRequested(job_id=job_id), source="test", time=T0)))


@pytest_asyncio.fixture
async def platform(fresh: tuple[str, str]) -> AsyncIterator[Users]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    rt = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                        clock=ManualClock(), database_url=database_url)
    await rt.start()
    try:
        yield Users(nc.jetstream(), conn, ManualClock())
    finally:
        await rt.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def wait_for(check: Callable[[], Awaitable[Any]]) -> None:
    for _ in range(300):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("timed out")


async def test_a_user_past_a_limit_is_refused_and_others_go_on(platform: Users) -> None:
    p = platform
    await p.submit_as("nb-1", "alice", kind=JobKind.NOTEBOOK)
    await p.submit_as("nb-2", "alice", kind=JobKind.NOTEBOOK)  # the notebook class's max_per_user: 1
    await p.submit_as("a-1", "alice", gpus=4)
    await p.submit_as("a-2", "alice", gpus=2)  # 1 + 4 + 2 = 7 GPUs > per_user.max_gpus 6
    await p.submit_as("a-3", "alice")  # the 3rd of alice's jobs waiting or running: per_user.max_jobs
    await p.submit_as("a-4", "alice")  # a 4th
    await p.submit_as("nb-3", "bob", kind=JobKind.NOTEBOOK)  # another user: his own count
    await p.submit_as("svc-1", None, gpus=8)  # no user (a team's service credential): team limits only
    await p.submit_as("b-1", "alice", team="team-b")  # another team: its own policy (none)
    verdicts = {job: (verdict, reason, message) for job, verdict, reason, message in await p.verdicts(9)}
    refused = {j: v for j, v in verdicts.items() if v[0] == "rejected"}
    assert sorted(refused) == ["a-2", "a-4", "nb-2"], verdicts
    assert {v[1] for v in refused.values()} == {"UserLimit"}
    assert "already has 1 notebook job(s) waiting or running" in refused["nb-2"][2]
    assert "job_classes.notebook.max_per_user" in refused["nb-2"][2]
    assert "exceeds team team-a's per-user limit of 6 (per_user.max_gpus)" in refused["a-2"][2]
    assert "already has 3 job(s) waiting or running" in refused["a-4"][2]
    assert await p.conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id IN ('a-2', 'a-4', 'nb-2')") == 0
    # alice's notebook ends: she may open another
    await p.cancel("nb-1")
    await wait_for(lambda: p.conn.fetchval("SELECT outcome = 'Cancelled' FROM admission.jobs WHERE job_id = 'nb-1'"))
    await p.submit_as("nb-2", "alice", kind=JobKind.NOTEBOOK)
    await wait_for(lambda: p.conn.fetchval(
        "SELECT count(*) = 2 FROM admission.submissions WHERE job_id = 'nb-2'"))
    assert await p.conn.fetchval("SELECT verdict FROM admission.submissions WHERE job_id = 'nb-2' ORDER BY at DESC, "
                                 "verdict LIMIT 1") == "queued"
