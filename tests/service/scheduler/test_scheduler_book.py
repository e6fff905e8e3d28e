"""The scheduler keeps its waiting order and running timeline in memory, event by event (services/core/pipeline/
book.py): after a random run of admissions, re-admissions, starts, requeues, ends and cancellations, what it holds
is what a scheduler rebuilding from the tables holds, and its placements are written whole (one statement per
cycle)."""

from __future__ import annotations

import json
import random
from datetime import timedelta

import asyncpg

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import (
    JobAdmitted,
    JobCancelled,
    JobCompleted,
    JobRequeued,
    JobStarted,
    NodeInventory,
    Payload,
    encode_event,
    make_event,
)
from shared.service import ServiceRuntime, Tx
from tests.service.scheduler.test_scheduler_service import NODES, T0

QUEUES = parse_queues({
    "priority_classes": [{"name": "low", "value": 10, "preemptible": True},
                         {"name": "normal", "value": 50, "preemptible": True},
                         {"name": "high", "value": 100, "preemptible": False}],
    "queues": [{"name": "t", "quotas": {"H100": {"nominal": 1000}}}]})


async def test_memory_after_random_events_equals_a_rebuild_from_the_tables(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    clock = ManualClock(T0.timestamp())
    service = SchedulerService(queues=QUEUES)
    runtime = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=clock, database_url=database_url)
    await runtime.start()
    rng = random.Random(16)
    n = 0

    async def send(payload: Payload) -> None:
        nonlocal n
        n += 1
        clock.advance(1.0)
        at = T0 + timedelta(seconds=n)
        assert await runtime.handle(encode_event(make_event(payload, source="test", time=at))) == "handled"

    def admitted(job_id: str) -> JobAdmitted:
        spec = JobSpec(job_id=job_id, team="t", queue="t", priority_class=rng.choice(["low", "normal", "high"]),
                       max_runtime_s=rng.choice([600, 3600, 7200]),
                       pod_sets=(PodSet(count=rng.choice([1, 1, 2]), gpus_per_pod=rng.choice([1, 4, 8])),))
        # admission times tie now and then: the id decides the order then
        return JobAdmitted(job_id=job_id, spec=spec, flavors={"main": "H100"},
                           admitted_at=T0 + timedelta(seconds=rng.randrange(0, 400, 7)))

    try:
        await send(NodeInventory(nodes=NODES))  # 4 nodes of 8 GPUs: most of the 60 jobs wait at any moment
        jobs = [f"job-{i:02d}" for i in range(60)]
        for _ in range(400):
            job_id = rng.choice(jobs)
            placed = set(service.book.placed)
            roll = rng.random()
            if roll < 0.4:
                await send(admitted(job_id))  # new, or a re-admission of a waiting or finished job
            elif roll < 0.6 and placed:
                await send(JobStarted(job_id=rng.choice(sorted(placed)), started_at=T0 + timedelta(seconds=n)))
            elif roll < 0.8 and placed:
                await send(JobCompleted(job_id=rng.choice(sorted(placed)), finished_at=T0))
            elif roll < 0.9:
                spec = admitted(job_id).spec
                await send(JobRequeued(job_id=job_id, spec=spec, resume_from=f"ckpt://{job_id}", submitted_at=T0))
            else:
                await send(JobCancelled(job_id=job_id, by="test"))
            assert service.book.view() == service.book.rebuilt()
        assert service.book.placed and service.book.waiting, "the run should end with jobs both placed and waiting"

        again = SchedulerService(queues=QUEUES)
        async with pool.acquire() as conn:
            await again._rebuild(conn)
            rows = await conn.fetch("SELECT job_id, status, bindings FROM scheduler.jobs WHERE status = 'placed'")
        assert again.book.view() == service.book.view()
        assert dict(again.book.placed) == dict(service.book.placed)
        assert again.resume == service.resume and again.reasons == service.reasons
        # every placement in memory is in the table with its bindings, and on the cluster state
        assert {r["job_id"] for r in rows} == set(service.book.placed)
        for r in rows:
            held = service.cluster.allocations()[r["job_id"]]
            assert sorted(b["node"] for b in json.loads(r["bindings"])) == sorted(b.node for b in held.bindings)
    finally:
        await runtime.stop()
        await pool.close()


async def test_the_placements_of_one_cycle_are_written_in_one_statement(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    service = SchedulerService()
    runtime = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=ManualClock(T0.timestamp()),
                             database_url=database_url)
    await runtime.start()
    conn = await asyncpg.connect(database_url)
    try:
        for i in range(3):  # no node known yet: the three wait
            spec = JobSpec(job_id=f"w-{i}", team="t", queue="t", pod_sets=(PodSet(count=1, gpus_per_pod=8),))
            payload = JobAdmitted(job_id=spec.job_id, spec=spec, flavors={"main": "H100"},
                                  admitted_at=T0 + timedelta(seconds=i))
            assert await runtime.handle(encode_event(make_event(payload, source="test", time=T0))) == "handled"
        assert set(service.book.waiting) == {"w-0", "w-1", "w-2"}
        # The inventory's cycle places all three: one UPDATE of their rows.
        statements: list[str] = []
        conn.add_query_logger(lambda record: statements.append(record.query))
        inventory = NodeInventory(nodes=NODES)
        async with conn.transaction():
            tx = Tx(conn=conn, now=T0.timestamp() + 10, source="test", schema="scheduler")
            await service.on_inventory(tx, make_event(inventory, source="test", time=T0), inventory)
        placed = await conn.fetch("SELECT job_id, fencing_token, expected_end, placed_at, bindings "
                                  "FROM scheduler.jobs WHERE status = 'placed' ORDER BY job_id")
        assert [r["job_id"] for r in placed] == ["w-0", "w-1", "w-2"]
        assert runtime.lease is not None and all(r["fencing_token"] == runtime.lease.term for r in placed)
        assert all(r["expected_end"] == r["placed_at"] + spec.max_runtime_s for r in placed)
        assert [len(json.loads(r["bindings"])[0]["gpu_indices"]) for r in placed] == [8, 8, 8]
        writes = [q for q in statements if "status = 'placed'" in q and q.lstrip().startswith("UPDATE")]
        assert len(writes) == 1, writes
        assert [e.type for e in tx.emitted].count("io.gpuq.job.placed.v1") == 3
        assert not service.book.waiting and sorted(service.book.placed) == ["w-0", "w-1", "w-2"]
    finally:
        await conn.close()
        await runtime.stop()
        await pool.close()
