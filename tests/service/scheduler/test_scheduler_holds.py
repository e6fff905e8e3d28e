"""The capacity a preemption frees is held for its preemptor (issue 51), in the scheduler service on real NATS and
Postgres: another admitted job waits while the hold stands, across a restart; it is placed once the preemptor is
cancelled, or once the hold expires with no event at all."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import nats

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_cluster
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import (
    JobAdmitted,
    JobCancelled,
    JobPreempted,
    NodeInventory,
    Payload,
    PreemptionReason,
    encode_event,
    make_event,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

NODES = tuple(parse_cluster({"node_groups": [
    {"name": "h100", "count": 1, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000,
     "memory_mib": 512000}]}).nodes())
T0 = datetime(2026, 1, 1, tzinfo=UTC)
HOLD_S = 300.0  # no queue configuration: the default checkpoint grace


def _admitted(job_id: str, team: str) -> JobAdmitted:
    spec = JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=8),))
    return JobAdmitted(job_id=job_id, spec=spec, flavors={"main": "H100"}, admitted_at=T0)


async def _wait_for(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def _scenario(nats_url: str, database_url: str, end_the_hold: str) -> None:
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()

    async def send(subject: str, payload: Payload) -> None:
        await js.publish(ns_subject(subject), encode_event(make_event(payload, source="test", time=T0)))

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = $1", job_id)

    def runtime() -> ServiceRuntime:
        return ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=clock,
                              database_url=database_url)

    first = runtime()
    await first.start()
    try:
        await send("node.inventory", NodeInventory(nodes=NODES))
        await send("job.admitted", _admitted("a-low", "team-a"))
        await _wait_for(lambda: _is(status("a-low"), "placed"))
        await send("job.admitted", _admitted("b-job", "team-b"))
        await _wait_for(lambda: _is(conn.fetchval("SELECT reason FROM scheduler.jobs WHERE job_id = 'b-job'"),
                                    "InsufficientGpus"))
        # a-high (not yet admitted) preempted a-low: its node is held for a-high, b-job is not placed on it
        await send("job.preempted", JobPreempted(job_id="a-low", reason=PreemptionReason.PRIORITY, preemptor="a-high",
                                                 preempted_at=T0))
        await _wait_for(lambda: _is(status("a-low"), "finished"))
        assert await conn.fetchval("SELECT preemptor FROM scheduler.holds WHERE victim = 'a-low'") == "a-high"
        row = await conn.fetchrow("SELECT status, reason, message FROM scheduler.jobs WHERE job_id = 'b-job'")
        assert row["status"] == "waiting" and row["reason"] == "WaitingForReservation", row
        assert "held for a-high, which preempted a-low" in row["message"] and " UTC" in row["message"]
        # the hold survives a restart (memory rebuilt from scheduler.holds)
        await first.stop()
        second = runtime()
        await second.start()
        try:
            await send("job.admitted", _admitted("other", "team-c"))  # a cycle after the restart
            await _wait_for(lambda: _is(status("other"), "waiting"))
            await asyncio.sleep(0.3)
            assert await status("b-job") == "waiting"
            if end_the_hold == "cancel":
                await send("job.cancelled", JobCancelled(job_id="a-high", by="team:team-a", reason="by its owner"))
            else:
                clock.advance(HOLD_S + 1)  # no event: the hold loop notices the expiry and runs a cycle
            await _wait_for(lambda: _is(status("b-job"), "placed"))
            assert await conn.fetchval("SELECT count(*) FROM scheduler.holds") == 0
        finally:
            await second.stop()
    finally:
        await nc.close()
        await conn.close()
        await pool.close()


async def _is(value, wanted: object) -> bool:  # type: ignore[no-untyped-def]
    return await value == wanted


async def test_a_hold_ends_when_its_preemptor_is_cancelled(fresh: tuple[str, str]) -> None:
    await _scenario(*fresh, end_the_hold="cancel")


async def test_a_hold_ends_when_it_expires(fresh: tuple[str, str]) -> None:
    await _scenario(*fresh, end_the_hold="expiry")
