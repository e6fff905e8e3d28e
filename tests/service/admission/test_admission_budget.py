"""GPU-hour budgets end to end on real NATS + Postgres (issue 48): metering computes each budgeted team's use in its
period from its ledger (facts delivered through its handlers) and writes its read model (metering.v1_budgets);
admission judges new work against it: at 100% under `preemptible_only` non-preemptible work is refused (reason
BudgetExhausted, the id stays free) and preemptible work queues; under `approval` every new job waits for an admin; a
team under its budget is not affected. (Fails on the code before: no read model, every job queued.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats
import pytest_asyncio

from services.admission.app import AdmissionService
from services.metering import budgetmodel, budgets, store
from services.metering.testing import T0, at, deliver, event, placed, spec
from services.scheduler.nodes import MIGRATIONS as SCHEDULER_MIGRATIONS
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import apply_migrations, create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobCompleted, JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

H = 3600.0
TEAMS = ("team-a", "team-b", "team-c")
QUEUES: dict[str, Any] = {
    "priority_classes": [{"name": "normal", "value": 100}, {"name": "prod", "value": 1000, "preemptible": False}],
    "queues": [{"name": t, "teams": [t], "quotas": {"H100-80GB": {"nominal": 16}}} for t in TEAMS],
    "budgets": {"team-a": {"gpu_hours": 10}, "team-b": {"gpu_hours": 10, "on_exhausted": "approval"},
                "team-c": {"gpu_hours": 100, "period": "quarter"}}}


class Platform:
    def __init__(self, pool: asyncpg.Pool, conn: asyncpg.Connection, js: Any) -> None:
        self.pool, self.conn, self.js = pool, conn, js

    async def submit(self, job_id: str, team: str, priority_class: str = "normal") -> None:
        job = JobSpec(job_id=job_id, team=team, queue=team, priority_class=priority_class,
                      pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),))
        await self.js.publish(ns_subject(f"job.submitted.{team}"), encode_event(make_event(
            JobSubmitted(spec=job, submitted_at=T0), source="test", time=T0)))

    async def verdicts(self, n: int) -> dict[str, tuple[str, str | None, str]]:
        for _ in range(300):
            rows = await self.conn.fetch("SELECT job_id, verdict, reason, coalesce(message, '') AS message "
                                         "FROM admission.submissions")
            if len(rows) >= n:
                return {r["job_id"]: (r["verdict"], r["reason"], r["message"]) for r in rows}
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {n} verdicts")


@pytest_asyncio.fixture
async def platform(fresh: tuple[str, str]) -> AsyncIterator[Platform]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    await store.migrate(pool)
    await apply_migrations(pool, "scheduler", SCHEDULER_MIGRATIONS)
    # admission's clock 3 hours into the ledger's day (T0 is a Monday in January 2025)
    rt = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool,
                        clock=ManualClock(T0.timestamp() + 3 * H), database_url=database_url)
    await rt.start()
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    try:
        yield Platform(pool, conn, nc.jetstream())
    finally:
        await rt.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_spent_budget_refuses_or_holds_new_work_by_its_policy(platform: Platform) -> None:
    p = platform
    a, b, c = (spec(f"{t[-1]}-old", team=t, gpus=8) for t in TEAMS)
    # team-a: 8 GPUs for 2 h (16 of 10 GPU-hours); team-b: 8 GPUs still held since 1 h 45 (14 at 3 h);
    # team-c: 8 GPUs for 1 h (8 of 100: ok)
    await deliver(p.pool, [event(placed(a, 0, ["h-0"]), 0), event(JobCompleted(job_id=a.job_id, finished_at=at(2 * H))),
                           event(placed(b, 1.25 * H, ["h-1"]), 1.25 * H),
                           event(placed(c, 0, ["h-2"]), 0), event(JobCompleted(job_id=c.job_id, finished_at=at(H)))])
    async with p.pool.acquire() as conn:
        await budgets.report_once(conn, at(3 * H))
        rows = {r.team: r for r in await budgetmodel.budgets(conn)}
    assert {t: (r.state, round(r.used_gpu_hours, 6)) for t, r in rows.items()} == {
        "team-a": ("exhausted", 16.0), "team-b": ("exhausted", 14.0), "team-c": ("ok", 8.0)}
    assert rows["team-a"].period == "2025-01" and rows["team-c"].period == "2025-Q1"
    assert rows["team-c"].forecast_gpu_hours > rows["team-c"].used_gpu_hours

    await p.submit("a-prod", "team-a", "prod")  # not preemptible: refused
    await p.submit("a-low", "team-a")  # preemptible: queued
    await p.submit("b-1", "team-b")  # approval: waits for an admin
    await p.submit("c-prod", "team-c", "prod")  # under budget
    verdicts = await p.verdicts(4)
    assert verdicts["a-prod"][:2] == ("rejected", "BudgetExhausted")
    assert "budget for 2025-01 is spent: only preemptible work" in verdicts["a-prod"][2]
    assert verdicts["a-low"][0] == "queued" and verdicts["c-prod"][0] == "queued"
    assert verdicts["b-1"][:2] == ("awaiting_approval", "AwaitingApproval")
    assert "gpuq approve b-1" in verdicts["b-1"][2]
    assert await p.conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id = 'a-prod'") == 0

    # a budget raised in the configuration: the next report lifts it
    async with p.pool.acquire() as conn:
        rows_after = await budgets.compute(conn, parse_queues({**QUEUES, "budgets": {"team-a": {"gpu_hours": 40}}}),
                                           at(3 * H))
    assert [(r.team, r.state.value) for r in rows_after] == [("team-a", "ok")]
