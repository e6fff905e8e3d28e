"""The cancel that lands just before a placement, through the metering service on real NATS + Postgres (issue 43
item 6): admission stamps JobCancelled while the scheduler, not having heard it, places the job a moment later.
Every such placement must be closed in the ledger, whichever event the service consumes first and whether they
come in one pulled batch (facts held for the batch's end) or one by one; a placement the cancel came after is
charged until the cancel."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import nats

from services.metering import store
from services.metering.app import build_spec
from services.metering.testing import QUEUES_DOC, at, placed, spec
from services.stack import StackSettings
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.events import CloudEvent, JobCancelled, JobStarted, Payload, encode_event, make_event
from shared.service import ServiceRuntime


def event(payload: Payload, seconds: float) -> CloudEvent:
    return make_event(payload, source="test", time=at(seconds))


async def publish(nats_url: str, events: list[CloudEvent]) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for e in events:
            await js.publish(type(e.payload()).subject(), encode_event(e), headers={"Nats-Msg-Id": e.id})
    finally:
        await nc.close()


async def handled(pool: asyncpg.Pool, events: list[CloudEvent], timeout: float = 30.0) -> None:
    """Until every event's inbox row is committed (its fact and the rebuilt allocations commit with it)."""
    ids = [e.id for e in events]
    deadline = asyncio.get_running_loop().time() + timeout
    while await pool.fetchval("SELECT count(*) FROM metering.inbox WHERE event_id = ANY($1)", ids) < len(ids):
        assert asyncio.get_running_loop().time() < deadline, "metering did not handle every event"
        await asyncio.sleep(0.1)


def cancel(job_id: str, seconds: float) -> CloudEvent:
    return event(JobCancelled(job_id=job_id, by="team:team-a", cancelled_at=at(seconds)), seconds)


def place(job_id: str, seconds: float, node: str) -> CloudEvent:
    return event(placed(spec(job_id), seconds, [node]), seconds)


async def test_a_cancel_just_before_the_placement_leaves_no_open_charge(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=parse_queues(QUEUES_DOC))
    runtime = ServiceRuntime(build_spec(settings), nats_url=nats_url, pool=pool, clock=ManualClock())
    # Before the service starts: one pull brings them all (a batch, its facts written at its end).
    batched = [cancel("raced-batch", 10.0), place("raced-batch", 10.2, "h-0"),
               event(JobStarted(job_id="raced-batch", started_at=at(10.5)), 10.5)]
    await publish(nats_url, batched)
    await runtime.start()
    try:
        await handled(pool, batched)
        # One at a time, each waited for: the cancel committed before the placement arrives, and the reverse.
        one_by_one = [cancel("raced-live", 20.0), place("raced-live", 20.5, "h-1"),
                      place("placed-late", 30.0, "h-2"), cancel("placed-late", 29.9),
                      place("kept", 0.0, "h-3"), event(JobStarted(job_id="kept", started_at=at(1)), 1),
                      cancel("kept", 60.0)]
        for e in one_by_one:
            await publish(nats_url, [e])
            await handled(pool, [e])
        rows = {r["job_id"]: r for r in await pool.fetch(
            "SELECT job_id, placed_at, started_at, ended_at, end_kind FROM metering.allocations")}
        assert set(rows) == {"raced-batch", "raced-live", "placed-late", "kept"}
        open_ = [j for j, r in rows.items() if r["ended_at"] is None]
        assert open_ == [], f"placements still charged after their job's cancel: {open_}"
        for job in ("raced-batch", "raced-live", "placed-late"):  # placed after the cancel: charged nothing
            assert (rows[job]["ended_at"], rows[job]["end_kind"]) == (rows[job]["placed_at"], "cancelled")
        assert rows["kept"]["ended_at"] - rows["kept"]["placed_at"] == timedelta(seconds=60)
        async with pool.acquire() as conn:
            [team] = await store.team_summary(conn)
        assert team["allocated_gpu_hours"] == round(8 * 60 / 3600, 4)  # only "kept": 8 GPUs for a minute
    finally:
        await runtime.stop()
        await pool.close()
