"""Elastic jobs resized by the services on real NATS + Postgres (issue 48 item 2; docs/scheduler.md "Elastic jobs"):
admission and the scheduler together grow a running elastic job pod by pod into idle GPUs within its queue's quota
(JobGrowRequested -> JobResizeAdmitted -> JobResized, the charge following the pods), shrink it for an admitted job
that does not fit before anyone asks for preemption, and give pods back for a job waiting for admission in its
cohort before any reclaim."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import nats
import pytest

from services.admission import elastic as elastic_charges
from services.admission.app import AdmissionService
from services.scheduler import elastic as scheduler_elastic
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, NodeSpec, PodSet
from shared.events import (
    JobGrowRequested,
    JobResizeAdmitted,
    JobResized,
    JobSubmitted,
    NodeInventory,
    Payload,
    PreemptionRequested,
    make_event,
    utcnow_from,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime, default_subject, publish_event

MODEL = "H100"


def config(a: int, b: int, cohort: str | None = None) -> dict[str, Any]:
    return {"priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
            "queues": [{"name": q, "teams": [q], "cohort": cohort, "quotas": {MODEL: {"nominal": n}}}
                       for q, n in (("team-a", a), ("team-b", b))],
            **({"cohorts": [{"name": cohort}]} if cohort else {})}


def elastic(job_id: str, count: int = 8, floor: int = 2) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", max_runtime_s=86_400,
                   pod_sets=(PodSet(name="worker", count=count, min_count=floor, gpus_per_pod=1,
                                    gpu_models=(MODEL,)),))


def fixed(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-b", queue="team-b", max_runtime_s=86_400,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus, gpu_models=(MODEL,)),))


@dataclass
class Stack:
    conn: asyncpg.Connection
    send: Callable[[Payload, str | None], Awaitable[None]]

    async def submit(self, spec: JobSpec) -> None:
        await self.send(JobSubmitted(spec=spec, submitted_at=utcnow_from(0.0)),
                        ns_subject(f"job.submitted.{spec.team}"))

    async def pods(self, job_id: str) -> int:
        raw = await self.conn.fetchval("SELECT bindings FROM scheduler.jobs WHERE job_id = $1 AND status = 'placed'",
                                       job_id)
        return len(json.loads(raw)) if raw is not None else 0

    async def charge(self, job_id: str) -> dict[str, int]:
        raw = await self.conn.fetchval("SELECT usage FROM admission.jobs WHERE job_id = $1", job_id)
        return dict(json.loads(raw)) if raw is not None else {}

    async def emitted(self, schema: str, payload: type[Payload]) -> list[dict[str, Any]]:
        rows = await self.conn.fetch(f"SELECT body FROM {schema}.outbox ORDER BY seq")
        return [e["data"] for e in (json.loads(bytes(r["body"])) for r in rows) if e["type"] == payload.event_type()]

    async def describe(self) -> str:
        jobs = await self.conn.fetch("SELECT job_id, status, reason, message, jsonb_array_length(bindings) AS pods "
                                     "FROM scheduler.jobs ORDER BY job_id")
        charged = await self.conn.fetch("SELECT job_id, status, usage, reason FROM admission.jobs ORDER BY job_id")
        return f"scheduler {[dict(r) for r in jobs]}; admission {[dict(r) for r in charged]}"

    async def settled(self, check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
        """Until `check` holds and both services' outboxes are published (nothing more on its way)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if await check():
                await asyncio.sleep(0.3)
                if await check():
                    return
            assert asyncio.get_running_loop().time() < deadline, f"timed out: {await self.describe()}"
            await asyncio.sleep(0.05)


@asynccontextmanager
async def stack(fresh: tuple[str, str], queues: dict[str, Any], gpus: int) -> AsyncIterator[Stack]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    cfg = parse_queues(queues)
    admission = ServiceRuntime(AdmissionService(cfg).spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)
    scheduler = ServiceRuntime(SchedulerService(queues=cfg).spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)

    async def send(payload: Payload, subject: str | None = None) -> None:
        event = make_event(payload, source="test", time=utcnow_from(clock.now()))
        await publish_event(js, event, subject or default_subject(payload))

    await scheduler.start()
    await admission.start()
    try:
        await send(NodeInventory(nodes=tuple(
            NodeSpec(name=f"n-{i}", gpus=8, gpu_model=MODEL, cpu_milli=96000, memory_mib=1 << 20, rack="r-0",
                     block="b-0")
            for i in range(gpus // 8))), None)
        yield Stack(conn, send)
    finally:
        await admission.stop()
        await scheduler.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_running_elastic_job_grows_pod_by_pod_into_idle_gpus_within_its_quota(fresh: tuple[str, str]) -> None:
    """16 GPUs, team-a's nominal quota 6: the job starts at its floor of 2 and grows one pod per grant to 6, charged
    6 GPUs; the seventh pod is refused for quota and GPUs stay idle. (Old code: it stays at 2 pods, 2 charged.)"""
    async with stack(fresh, config(6, 8), gpus=16) as s:
        await s.submit(elastic("el"))

        async def grown() -> bool:
            return await s.pods("el") == 6 and await s.charge("el") == {MODEL: 6}

        await s.settled(grown)
        resized = await s.emitted("scheduler", JobResized)
        assert [(r["pods_before"], r["pods"], r["reason"]) for r in resized] == [
            (n, n + 1, "Grow") for n in range(2, 6)]
        assert [r["pods"] for r in await s.emitted("scheduler", JobGrowRequested)] == [3, 4, 5, 6, 7]
        answers = await s.emitted("admission", JobResizeAdmitted)
        assert [(a["pods"], a["granted"]) for a in answers] == [(3, True), (4, True), (5, True), (6, True),
                                                                 (6, False)]
        assert "no room to grow el to 7 pods" in answers[-1]["message"]
        assert await s.conn.fetchval("SELECT charged_pods FROM admission.jobs WHERE job_id = 'el'") == 6


async def test_an_elastic_job_shrinks_for_an_admitted_job_before_any_preemption(fresh: tuple[str, str]) -> None:
    """8 GPUs, each team's quota 8 (more than the cluster): team-a's job grows to 8; team-b's 4-GPU job is admitted
    and does not fit, so team-a's job is shrunk to its floor and team-b's placed, with no preemption asked; it then
    regrows into the 2 GPUs left idle, its charge following (4). (Mutant: no shrink before preemption -> team-b
    waits and asks for preemption.)"""
    async with stack(fresh, config(8, 8), gpus=8) as s:
        await s.submit(elastic("el"))

        async def full() -> bool:
            return await s.pods("el") == 8 and await s.charge("el") == {MODEL: 8}

        await s.settled(full)
        await s.submit(fixed("b", 4))

        async def made_room() -> bool:
            return (await s.pods("b") == 1 and await s.pods("el") == 4
                    and await s.charge("el") == {MODEL: 4})

        # shrunk to its floor (whole jobs at a time) for b, then grown again into the 2 GPUs b left idle
        await s.settled(made_room)
        resized = [(r["pods_before"], r["pods"], r["reason"], r["for_job"])
                   for r in await s.emitted("scheduler", JobResized)]
        assert resized[-3:] == [(8, 2, "Shrink", "b"), (2, 3, "Grow", None), (3, 4, "Grow", None)]
        assert await s.emitted("scheduler", PreemptionRequested) == []


async def test_pods_above_a_floor_are_given_back_for_a_job_waiting_for_admission(fresh: tuple[str, str]) -> None:
    """A cohort of team-a (4) and team-b (4) on 8 GPUs: team-a's elastic job grows to 8 by borrowing team-b's quota;
    team-b's 4-GPU job then waits for admission, so admission asks back the 4 pods above team-a's nominal, the
    scheduler takes them back, the charge is released, and team-b's job is admitted and placed with no reclaim.
    (Mutant: no give-back -> admission asks preemption to reclaim its quota.)"""
    async with stack(fresh, config(4, 4, cohort="c"), gpus=8) as s:
        await s.submit(elastic("el"))

        async def borrowed() -> bool:
            return await s.pods("el") == 8 and await s.charge("el") == {MODEL: 8}

        await s.settled(borrowed)
        await s.submit(fixed("b", 4))

        async def given_back() -> bool:
            return (await s.pods("b") == 1 and await s.pods("el") == 4
                    and await s.charge("el") == {MODEL: 4})

        await s.settled(given_back)
        asked = [a for a in await s.emitted("admission", JobResizeAdmitted) if a["pods"] == 4 and a["granted"]]
        assert asked and "given back" in asked[-1]["message"]
        assert await s.emitted("admission", PreemptionRequested) == []
        assert await s.emitted("scheduler", PreemptionRequested) == []


async def test_a_failure_between_steps_neither_loses_nor_duplicates_a_charge_or_a_placement(
        fresh: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first grant's unit of work in admission and the first resize's in the scheduler each fail after their
    rows and events were written (rolled back, memory rebuilt, the event redelivered): the job still grows one pod
    per step to 6, each size placed once and charged once. (Mutant: the scheduler's memory not rebuilt after a
    failed unit of work -> the redelivered grant finds the pod placed already: the resize to 3 is never told.)"""
    failures = {"admission": 1, "scheduler": 1}
    write, resized = elastic_charges.ElasticCharges._write, scheduler_elastic.resized

    async def failing_write(self: Any, tx: Any, state: Any, job_id: str) -> None:
        await write(self, tx, state, job_id)
        if failures["admission"]:
            failures["admission"] -= 1
            raise RuntimeError("admission fails after charging")

    async def failing_resized(*args: Any) -> None:
        await resized(*args)
        if failures["scheduler"]:
            failures["scheduler"] -= 1
            raise RuntimeError("scheduler fails after resizing")

    monkeypatch.setattr(elastic_charges.ElasticCharges, "_write", failing_write)
    monkeypatch.setattr(scheduler_elastic, "resized", failing_resized)
    async with stack(fresh, config(6, 8), gpus=16) as s:
        await s.submit(elastic("el"))

        async def grown() -> bool:
            return await s.pods("el") == 6 and await s.charge("el") == {MODEL: 6}

        await s.settled(grown)
        assert failures == {"admission": 0, "scheduler": 0}
        resized_events = [(r["pods_before"], r["pods"]) for r in await s.emitted("scheduler", JobResized)]
        assert resized_events == [(n, n + 1) for n in range(2, 6)]
        granted = [a["pods"] for a in await s.emitted("admission", JobResizeAdmitted) if a["granted"]]
        assert granted == [3, 4, 5, 6]
        assert await s.conn.fetchval("SELECT charged_pods FROM admission.jobs WHERE job_id = 'el'") == 6
