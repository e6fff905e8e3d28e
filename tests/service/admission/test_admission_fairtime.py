"""Scheduling over time in the admission service, on real NATS + Postgres: duration-aware ordering from the run-time
history of finished jobs (policy.duration_ordering), kept across a restart; fair share over time from the metering
service's read model of decayed usage (policy.usage_half_life_s, QueueUsageReported)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from types import SimpleNamespace

import asyncpg
import nats

from services.admission.app import AdmissionService
from services.metering.app import build_spec as metering_spec
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import (
    JobCompleted,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    Payload,
    QueueUsageReported,
    encode_event,
    make_event,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LIMIT_S = 36_000  # every job's limit: only the history tells a quick job from a slow one


def queues(**policy: object) -> dict:
    return {"priority_classes": [{"name": "normal", "value": 100}], "policy": policy,
            "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100": {"nominal": 10}}}]}


def spec(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", user="ana", max_runtime_s=LIMIT_S,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))


def encoded(payload: Payload) -> bytes:
    return encode_event(make_event(payload, source="test", time=T0))


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_duration_ordering_puts_a_short_job_before_a_long_one_once_history_exists_and_after_restart(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    config = parse_queues(queues(duration_ordering=True))

    def runtime() -> ServiceRuntime:
        return ServiceRuntime(AdmissionService(config).spec(), nats_url=nats_url, pool=pool, clock=clock,
                              database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    async def positions() -> dict[str, int]:
        rows = await conn.fetch("SELECT job_id, position_in_queue FROM admission.jobs WHERE status = 'pending'")
        return {r["job_id"]: r["position_in_queue"] for r in rows}

    svc = runtime()
    await svc.start()
    try:
        # History: five "quick" runs of 60 s and five "slow" runs of 30,000 s (same user, same limit).
        history = [f"quick-{i}" for i in range(5)] + [f"slow-{i}" for i in range(5)]
        for job_id in history:
            await js.publish(ns_subject("job.submitted.team-a"), encoded(JobSubmitted(spec=spec(job_id, 1),
                                                                                      submitted_at=T0)))
        for job_id in history:
            await until(lambda j=job_id: _eq(status(j), "admitted"))
            await js.publish(ns_subject("job.started"), encoded(JobStarted(job_id=job_id,
                                                                           started_at=utcnow_from(clock.now()))))

        async def started(job_ids: list[str]) -> bool:
            n = await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id = ANY($1::text[]) AND "
                                    "started_at IS NOT NULL", job_ids)
            return bool(n == len(job_ids))

        await until(lambda: started(history))
        for ran, stem in ((60, "quick"), (30_000, "slow")):
            clock.set(clock.now() + ran if stem == "quick" else clock.now() + ran - 60)
            for i in range(5):
                await js.publish(ns_subject("job.completed"), encoded(JobCompleted(
                    job_id=f"{stem}-{i}", finished_at=utcnow_from(clock.now()))))
            for i in range(5):
                await until(lambda j=f"{stem}-{i}": _eq(status(j), "finished"))

        # The queue's 10 GPUs are taken; a slow job, then a quick one (both whole-queue jobs) wait.
        for job_id, gpus in (("blocker", 10), ("slow-100", 10), ("quick-100", 10)):
            clock.advance(1)
            await js.publish(ns_subject("job.submitted.team-a"), encoded(JobSubmitted(spec=spec(job_id, gpus),
                                                                                      submitted_at=T0)))
            await until(lambda j=job_id: _eq(status(j), "admitted" if j == "blocker" else "pending"))
        await until(lambda: _eq(positions(), {"quick-100": 1, "slow-100": 2}))  # FIFO would put slow-100 first
        stored = await conn.fetchval("SELECT predicted_gpu_s FROM admission.jobs WHERE job_id = 'quick-100'")
        assert stored is not None and stored < 10 * 1000  # about 60 s x 10 GPUs, not the 36,000 s limit
    finally:
        await svc.stop()

    # Restart: the waiting jobs keep their places, and the history is rebuilt from the finished jobs, so a quick
    # job submitted now still goes before the slow one that waits (with no history it would be predicted at
    # its limit and wait behind it).
    svc = runtime()
    await svc.start()
    try:
        clock.advance(1)
        await js.publish(ns_subject("job.submitted.team-a"), encoded(JobSubmitted(spec=spec("quick-101", 10),
                                                                                  submitted_at=T0)))
        await until(lambda: _eq(positions(), {"quick-100": 1, "quick-101": 2, "slow-100": 3}))
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _eq(value: Awaitable[object], expected: object) -> bool:
    return (await value) == expected


H100 = "H100-80GB"
DAY_S = 86_400


def cohort_queues(**policy: object) -> dict:
    """team-a and team-b share a cohort of 8 GPUs, 4 each."""
    return {"priority_classes": [{"name": "normal", "value": 100}], "policy": policy,
            "cohorts": [{"name": "research"}],
            "queues": [{"name": q, "cohort": "research", "teams": [q], "quotas": {H100: {"nominal": 4}}}
                       for q in ("team-a", "team-b")]}


def job(job_id: str, team: str, gpus: int = 8) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(H100,)),))


async def test_a_queue_that_borrowed_heavily_in_the_past_waits_behind_one_that_did_not(
        fresh: tuple[str, str]) -> None:
    """team-a held the whole cohort (8 GPUs, nominal 4) for two days until recently. Metering's report of the
    decayed usage reaches admission; then, with room for one of two equal 8-GPU jobs, team-b's goes first although
    team-a's waited longer (without history, the older one goes first: same priority, same current borrowing)."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    config = parse_queues(cohort_queues(usage_half_life_s=DAY_S))
    admission = ServiceRuntime(AdmissionService(config).spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)
    metering = ServiceRuntime(metering_spec(SimpleNamespace(queues=config)), nats_url=nats_url, pool=pool,
                              clock=clock, database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    async def reports() -> list[dict]:
        rows = await conn.fetch("SELECT body FROM metering.outbox WHERE published_at IS NOT NULL ORDER BY seq")
        events = [json.loads(bytes(r["body"])) for r in rows]
        return [e for e in events if e["type"] == QueueUsageReported.event_type()]

    await metering.start()
    await admission.start()
    try:
        # The ledger's history: team-a's 8 GPUs from two days ago until 2.4 hours ago.
        old = job("old-a", "team-a")
        now = clock.now()
        await js.publish(ns_subject("job.placed"), encoded(JobPlaced(
            job_id="old-a", spec=old, placed_at=utcnow_from(now - 2 * DAY_S),
            bindings=(GpuBinding(pod="main-0", node="h0", gpu_indices=tuple(range(8))),))))
        await js.publish(ns_subject("job.completed"), encoded(JobCompleted(
            job_id="old-a", finished_at=utcnow_from(now - 0.1 * DAY_S))))

        async def ledger_closed() -> bool:
            return bool(await conn.fetchval(
                "SELECT count(*) FROM metering.allocations WHERE job_id = 'old-a' AND ended_at IS NOT NULL"))

        await until(ledger_closed)
        # One job of team-a holds the cohort; one of each team waits.
        for job_id, team in (("a-hold", "team-a"), ("a-wait", "team-a"), ("b-wait", "team-b")):
            clock.advance(1)
            await js.publish(ns_subject(f"job.submitted.{team}"), encoded(JobSubmitted(spec=job(job_id, team),
                                                                                      submitted_at=T0)))
            await until(lambda j=job_id: _eq(status(j), "admitted" if j == "a-hold" else "pending"))

        clock.advance(300)  # the next report period: metering publishes the decayed usage

        async def reported() -> bool:
            got = await reports()
            return bool(got) and "team-a" in got[-1]["data"]["usage"]

        await until(reported)
        report = (await reports())[-1]
        average_gpus = report["data"]["usage"]["team-a"][H100] * 0.693147 / DAY_S
        assert 5 < average_gpus < 6  # above its nominal 4: it borrowed, on average, over the last days

        async def applied() -> bool:
            return bool(await conn.fetchval("SELECT count(*) FROM admission.inbox WHERE event_id = $1",
                                            report["id"]))

        await until(applied)
        await js.publish(ns_subject("job.completed"), encoded(JobCompleted(job_id="a-hold",
                                                                           finished_at=utcnow_from(clock.now()))))
        await until(lambda: _eq(status("b-wait"), "admitted"))
        assert await status("a-wait") == "pending"
    finally:
        await admission.stop()
        await metering.stop()
        await nc.close()
        await conn.close()
        await pool.close()


def test_with_an_eta_admission_predicts_with_the_etas_predictor_one_owner_of_the_history() -> None:
    """The history the ETA learns from is the one duration ordering reads (no second copy to drift apart)."""
    from services.eta.platform import PlatformEta

    eta = PlatformEta()
    service = AdmissionService(parse_queues(queues(duration_ordering=True)), eta=eta)
    quick = spec("quick-200", 2)
    assert service.predicted_gpu_s(quick) == 2 * LIMIT_S  # no history: the limit
    for i in range(5):
        eta.job_finished(spec(f"quick-{i}", 1), 60.0)
    assert service.predicted_gpu_s(quick) == 2 * eta.predicted_s(quick) < 2 * 1000
    off = AdmissionService(parse_queues(queues()), eta=eta)
    assert off.predicted_gpu_s(quick) is None  # policy off: no prediction, FIFO
