"""Raw GPU samples past GPUQ_METERING_RAW_RETENTION_DAYS are deleted by metering's retention loop, on a real
Postgres; the hourly rollups the reports read stay, so every report (by team, by day, the FOCUS export, the team
summary) is the same after as before."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest

from services.core.metering.rollup import Granularity
from services.metering import store
from services.metering.app import SPEC, build_spec, report_usage, sample_retention
from services.metering.budgets import report_budgets
from services.metering.report import focus_document, report_document
from services.metering.testing import QUEUES_DOC, T0, at, deliver, event, placed, sampled, spec
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.events import JobCompleted, JobStarted, QueueConfigChanged
from shared.retention import METERING_RAW
from shared.service import ServiceRuntime

HOUR, DAYS = 3600, 40


async def fill(pool: asyncpg.Pool) -> None:
    """A job on one node for 40 days, a sample of its 8 GPUs every hour, and another job's first day."""
    a = spec("long", team="team-a", gpus=8)
    b = spec("short", team="team-b", gpus=8)
    await deliver(pool, [event(QueueConfigChanged(config=QUEUES_DOC), -60),
                         event(placed(a, 0, ["h-0"]), 0), event(JobStarted(job_id="long", started_at=at(60)), 60),
                         event(placed(b, 0, ["h-1"]), 0),
                         event(JobCompleted(job_id="short", finished_at=at(24 * HOUR)), 24 * HOUR),
                         event(JobCompleted(job_id="long", finished_at=at(DAYS * 24 * HOUR)), DAYS * 24 * HOUR)])
    samples = [sampled("h-0", k * HOUR, "long", [float(k % 100)] * 8, interval_s=HOUR)
               for k in range(1, DAYS * 24 + 1)]
    samples += [sampled("h-1", k * HOUR, "short", [30.0] * 8, interval_s=HOUR) for k in range(1, 25)]
    async with pool.acquire() as conn:
        for i in range(0, len(samples), 200):
            await store.record_samples(conn, samples[i:i + 200])


async def reports(pool: asyncpg.Pool, url: str) -> dict[str, Any]:
    now = at(DAYS * 24 * HOUR)
    async with pool.acquire() as conn:
        summary = await store.team_summary(conn)
    return {"summary": summary,
            "by_team_day": await report_document(url, by="team", granularity=Granularity.DAY, now=now),
            "focus": await focus_document(url, now=now)}


async def test_raw_samples_past_the_window_go_and_the_reports_do_not_change(pool: asyncpg.Pool,
                                                                          metering_db_url: str) -> None:
    await fill(pool)
    before = await reports(pool, metering_db_url)
    assert before["summary"][0]["used_gpu_hours"] > 0 and len(before["focus"]) > DAYS
    total = await pool.fetchval("SELECT count(*) FROM metering.gpu_samples")
    assert total == (DAYS * 24 + 24) * 8

    # The service's loop, on the platform's clock at the end of the 40 days, with a 30-day window: its first pass
    # runs at start.
    now = T0 + timedelta(days=DAYS)
    runtime = ServiceRuntime(SPEC, nats_url="nats://127.0.0.1:1", pool=pool, clock=ManualClock(now.timestamp()))
    cutoff = now - timedelta(days=30)
    kept = await pool.fetchval("SELECT count(*) FROM metering.gpu_samples WHERE sampled_at >= $1", cutoff)
    assert 0 < kept < total
    loop = asyncio.create_task(sample_retention(30)(runtime))
    try:
        for _ in range(200):
            if await pool.fetchval("SELECT count(*) FROM metering.gpu_samples") == kept:
                break
            await asyncio.sleep(0.05)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert await pool.fetchval("SELECT count(*) FROM metering.gpu_samples") == kept
    assert await pool.fetchval("SELECT min(sampled_at) FROM metering.gpu_samples") >= cutoff

    assert await reports(pool, metering_db_url) == before
    # A sample still inside the window, delivered again, counts nothing twice.
    async with pool.acquire() as conn:
        assert await store.record_samples(conn, [sampled("h-0", DAYS * 24 * HOUR, "long", [99.0] * 8,
                                                         interval_s=HOUR)]) == 0
    assert await reports(pool, metering_db_url) == before


async def test_pruning_in_batches_deletes_exactly_the_samples_taken_before_the_cutoff(pool: asyncpg.Pool) -> None:
    await fill(pool)
    async with pool.acquire() as conn:
        deleted = await store.prune_samples(conn, at(10 * 24 * HOUR), batch=100)  # 22 batches
        assert deleted == (10 * 24 - 1) * 8 + 24 * 8  # samples 1..239 of h-0 and all 24 of h-1, 8 GPUs each
        assert await conn.fetchval("SELECT count(*) FROM metering.gpu_samples WHERE sampled_at < $1",
                                   at(10 * 24 * HOUR)) == 0


def test_the_window_comes_from_the_environment_with_its_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    queues = SimpleNamespace(queues=parse_queues(QUEUES_DOC))
    assert METERING_RAW.days({}) == 30
    monkeypatch.setenv("GPUQ_METERING_RAW_RETENTION_DAYS", "2")
    with pytest.raises(ValueError, match="below its floor of 3 days: a raw sample must outlive"):
        build_spec(queues)
    monkeypatch.setenv("GPUQ_METERING_RAW_RETENTION_DAYS", "0")  # keep everything: no retention loop
    assert build_spec(queues).background == (report_usage, report_budgets)
    monkeypatch.setenv("GPUQ_METERING_RAW_RETENTION_DAYS", "90")
    assert len(build_spec(queues).background) == 3
