"""Job retry with a backoff limit, through the services on NATS+Postgres with the simulated executor: the user's
promises of `JobSpec.retry` (docs/admission.md, "Retries of failed attempts")."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg
import nats

from services.api.readmodel import explain_lines, fetch_status
from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.domain import JobSpec, PodSet, RetryPolicy
from shared.events import JobSubmitted, make_event
from shared.namespace import subject as ns_subject
from shared.service import publish_event
from tests.system.reclaim_story import CLUSTER, QUEUES, wait_until
from tests.system.test_reclaim_scenario import events_on


def _job(job_id: str, outcome: str, retry: RetryPolicy, failed_attempts: int | None = None) -> JobSpec:
    labels = {"sim.gpuq.io/duration-s": "100", "sim.gpuq.io/outcome": outcome}
    if failed_attempts is not None:
        labels["sim.gpuq.io/failed-attempts"] = str(failed_attempts)
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", priority_class="low",
                   pod_sets=(PodSet(count=1, gpus_per_pod=1),), max_runtime_s=1000, labels=labels, retry=retry)


async def test_failed_attempts_are_retried_after_their_backoff_and_the_limit_ends_in_one_failure(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)  # 100 virtual seconds a wall second
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                             services=("admission", "scheduler", "preemption", "executor", "metering"), clock=clock)
    # fails once with Error, then succeeds: retried after 500 s (5 wall seconds)
    flaky = _job("r-flaky", "Error", RetryPolicy(backoff_limit=2, backoff_s=500, max_backoff_s=1000),
                 failed_attempts=1)
    # always fails with Error: two attempts, then one JobFailed
    broken = _job("r-broken", "Error", RetryPolicy(backoff_limit=1, backoff_s=10))
    # OOMKilled is not retried by default
    oom = _job("r-oom", "OOMKilled", RetryPolicy(backoff_limit=2, backoff_s=10))

    async def status(job_id: str) -> dict:
        rows = await fetch_status(database_url, job_id)
        return rows[0] if rows else {"state": "unknown"}

    async def is_state(job_id: str, state: str) -> bool:
        return (await status(job_id))["state"] == state

    async with Stack(settings):
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        for spec in (flaky, broken, oom):
            now = datetime.fromtimestamp(clock.now(), UTC)
            await publish_event(js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(spec.team))

        async def backing_off() -> bool:
            row = await status("r-flaky")
            return row["state"] == "pending" and row["reason"] == "BackoffAfterFailure"

        await wait_until(backing_off)
        row = await status("r-flaky")
        explained = "\n".join(explain_lines(row, clock.now()))
        assert "BackoffAfterFailure" in explained and "attempt 1 of 3 failed (Error" in explained
        await wait_until(lambda: is_state("r-flaky", "completed"))
        await wait_until(lambda: is_state("r-broken", "failed"))
        await wait_until(lambda: is_state("r-oom", "failed"))
        await nc.close()
        conn = await asyncpg.connect(database_url)
        allocations: dict[str, list[str]] = {}

        async def metered() -> bool:  # metering follows the bus at its own pace
            for job_id in ("r-flaky", "r-broken", "r-oom"):
                allocations[job_id] = [r["end_kind"] for r in await conn.fetch(
                    "SELECT end_kind FROM metering.allocations WHERE job_id = $1 ORDER BY placed_at", job_id)]
            return all(kinds and kinds[-1] is not None for kinds in allocations.values()) \
                and len(allocations["r-flaky"]) == 2 and len(allocations["r-broken"]) == 2

        try:
            await wait_until(metered)
        finally:
            await conn.close()

    attempt_failed = [e["data"] for e in await events_on(nats_url, ns_subject("job.attempt_failed"))]
    failed = [e["data"] for e in await events_on(nats_url, ns_subject("job.failed"))]
    completed = [e["data"]["job_id"] for e in await events_on(nats_url, ns_subject("job.completed"))]
    placed = [e["data"] for e in await events_on(nats_url, ns_subject("job.placed"))]

    # the flaky job: one failed attempt, retried not before its backoff, then completed; never a JobFailed
    flaky_attempts = [a for a in attempt_failed if a["job_id"] == "r-flaky"]
    assert len(flaky_attempts) == 1
    a = flaky_attempts[0]
    assert a["attempt"] == 1 and a["attempts_allowed"] == 3 and a["exit_reason"] == "Error"
    not_before = datetime.fromisoformat(a["retry_not_before"])
    assert (not_before - datetime.fromisoformat(a["finished_at"])).total_seconds() == 500
    flaky_placements = [datetime.fromisoformat(p["placed_at"]) for p in placed if p["job_id"] == "r-flaky"]
    assert len(flaky_placements) == 2 and flaky_placements[1] >= not_before
    assert "r-flaky" in completed and all(f["job_id"] != "r-flaky" for f in failed)

    # the broken job: attempt 1 retried, attempt 2 (the limit) fails once, saying after how many attempts
    assert [x["attempt"] for x in attempt_failed if x["job_id"] == "r-broken"] == [1]
    (broken_failed,) = [f for f in failed if f["job_id"] == "r-broken"]
    assert broken_failed["exit_reason"] == "Error" and broken_failed["attempts"] == 2
    assert "after 2 attempts" in broken_failed["message"]

    # OOMKilled: not retried by default
    assert all(x["job_id"] != "r-oom" for x in attempt_failed)
    (oom_failed,) = [f for f in failed if f["job_id"] == "r-oom"]
    assert oom_failed["exit_reason"] == "OOMKilled" and "OOMKilled is not retried" in oom_failed["message"]

    # metering charges each attempt once: one allocation per placement, each ended by its own outcome
    assert allocations["r-flaky"] == ["failed", "completed"]
    assert allocations["r-broken"] == ["failed", "failed"]
    assert allocations["r-oom"] == ["failed"]
