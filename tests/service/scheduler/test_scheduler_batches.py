"""A consumed batch's job rows are read and written once for the batch (services/scheduler/held.py): each row ends
as if every message had written its own, memory matches a rebuild from the tables after every batch, and a batch
that fails at its end loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta

import asyncpg
import nats
import pytest_asyncio

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.db import keep_session
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
from tests.service.scheduler.test_scheduler_book import QUEUES
from tests.service.scheduler.test_scheduler_service import NODES, T0


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def logged_pool(database_url: str, statements: list[str]) -> asyncpg.Pool:
    """A pool like the services' (shared.db.create_pool) whose connections log every statement they run."""
    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(lambda record: statements.append(record.query))

    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=10, reset=keep_session, init=init)
    assert pool is not None
    return pool


def spec_of(job_id: str, gpus: int = 8, max_runtime_s: int = 3600, priority: str = "normal") -> JobSpec:
    return JobSpec(job_id=job_id, team="t", queue="t", priority_class=priority, max_runtime_s=max_runtime_s,
                   pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))


def admitted(job_id: str, at: float = 0.0, **kw: object) -> JobAdmitted:
    return JobAdmitted(job_id=job_id, spec=spec_of(job_id, **kw), flavors={"main": "H100"},  # type: ignore[arg-type]
                       admitted_at=T0 + timedelta(seconds=at))


class Batches:
    """Publishes a list of events while the scheduler is stopped, then starts it, so that they arrive in one pull,
    and waits until it handled them all."""

    def __init__(self, nats_url: str, database_url: str, pool: asyncpg.Pool, service: SchedulerService,
                 clock: ManualClock, statements: list[str]):
        self.nats_url, self.database_url, self.pool, self.service, self.clock = (nats_url, database_url, pool,
                                                                                 service, clock)
        self.runtime: ServiceRuntime | None = None
        self.sent = 0
        self.statements = statements  # what `pool` logs

    async def one_pull(self, events: list[Payload]) -> ServiceRuntime:
        if self.runtime is not None:
            await self.runtime.stop()
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            for payload in events:
                self.sent += 1
                event = make_event(payload, source="test", time=T0 + timedelta(seconds=self.sent))
                await js.publish(payload.subject(), encode_event(event))
        finally:
            await nc.close()
        self.runtime = ServiceRuntime(self.service.spec(), nats_url=self.nats_url, pool=self.pool, clock=self.clock,
                                      database_url=self.database_url)
        await self.runtime.start()
        runtime = self.runtime

        async def all_handled() -> bool:
            async with self.pool.acquire() as conn:
                return await conn.fetchval("SELECT count(*) FROM scheduler.inbox") == self.sent

        await until(all_handled)
        await asyncio.sleep(0.1)  # the batch's acks and counters settle after its commit
        return runtime

    async def stop(self) -> None:
        if self.runtime is not None:
            await self.runtime.stop()


@pytest_asyncio.fixture
async def batches(fresh: tuple[str, str]) -> AsyncIterator[Batches]:
    """A stopped scheduler on a fresh bus and database whose pool logs every statement (`batches.statements`)."""
    nats_url, database_url = fresh
    statements: list[str] = []
    pool = await logged_pool(database_url, statements)
    b = Batches(nats_url, database_url, pool, SchedulerService(queues=QUEUES), ManualClock(T0.timestamp()), statements)
    try:
        yield b
    finally:
        await b.stop()
        await pool.close()


async def memory_matches_the_tables(service: SchedulerService, pool: asyncpg.Pool) -> None:
    again = SchedulerService(queues=service.queues)
    async with pool.acquire() as conn:
        await again._rebuild(conn)
    assert again.book.view() == service.book.view()
    assert dict(again.book.placed) == dict(service.book.placed)
    assert again.resume == service.resume and again.reasons == service.reasons
    assert again.limits == service.limits
    assert sorted(again.cluster.allocations()) == sorted(service.cluster.allocations())


async def test_one_batch_reads_its_admissions_once_and_writes_each_kind_of_row_once(batches: Batches) -> None:
    service, pool, statements = batches.service, batches.pool, batches.statements
    # 4 nodes of 8 GPUs; then one pull: a cancel that overtakes its job's admission, six 8-GPU jobs.
    await batches.one_pull([NodeInventory(nodes=NODES)])  # the nodes' stream is consumed on its own
    await batches.one_pull([JobCancelled(job_id="gone", by="test"),
                            admitted("gone"), *(admitted(f"j{i}", at=i) for i in range(6))])
    assert batches.runtime is not None and batches.runtime.counters.batches == 1
    placed = sorted(service.book.placed)
    assert placed == ["j0", "j1", "j2", "j3"] and sorted(service.book.waiting) == ["j4", "j5"]
    job_writes = [q for q in statements if q.lstrip().startswith(("INSERT INTO scheduler.jobs",
                                                                  "UPDATE scheduler.jobs"))]
    assert len([q for q in job_writes if q.lstrip().startswith("INSERT")]) == 1, job_writes
    # the batch's read, and the one of "gone", whose cancel earlier in the pull the batch's read cannot answer
    assert len([q for q in statements if "LEFT JOIN scheduler.jobs j ON j.job_id = u.id" in q]) == 2
    await memory_matches_the_tables(service, pool)

    # The next pull: starts (one of a waiting job: nothing to start), a re-admission of a placed job (changes
    # nothing), a job that ends and is admitted again in the same pull (it waits again, behind j4), a cancel.
    statements.clear()
    start = T0 + timedelta(seconds=30)
    await batches.one_pull([JobStarted(job_id="j0", started_at=start), JobStarted(job_id="j1", started_at=start),
                            JobStarted(job_id="j4", started_at=start), admitted("j3", at=50),
                            JobCompleted(job_id="j1", finished_at=T0), admitted("j1", at=60),
                            JobCancelled(job_id="j5", by="test")])
    async with pool.acquire() as conn:
        rows = {r["job_id"]: (r["status"], r["started_at"], r["expected_end"], r["admitted_at"])
                for r in await conn.fetch("SELECT job_id, status, started_at, expected_end, admitted_at "
                                          "FROM scheduler.jobs")}
        tombstones = {r["job_id"] for r in await conn.fetch("SELECT job_id FROM scheduler.cancelled")}
    assert rows["j0"][:3] == ("placed", start.timestamp(), start.timestamp() + 3600)
    assert rows["j3"][0] == "placed" and rows["j3"][3] == (T0 + timedelta(seconds=3)).timestamp()
    assert rows["j4"][0] == "placed" and rows["j4"][1] is None  # j1's node went to j4, admitted before it
    assert rows["j1"][0] == "waiting" and rows["j1"][3] == (T0 + timedelta(seconds=60)).timestamp()
    assert rows["j5"][0] == "finished" and rows["j2"][0] == "placed"
    assert "gone" not in rows and tombstones == {"gone", "j5"}
    assert sorted(service.book.waiting) == ["j1"]
    assert service.book.placed["j0"][0] == start.timestamp() + 3600
    await memory_matches_the_tables(service, pool)


async def test_random_batches_keep_memory_equal_to_the_tables(batches: Batches) -> None:
    """Random pulls of admissions, re-admissions, starts, requeues, ends and cancellations: after every pull what the
    scheduler holds is what a scheduler rebuilding from the tables holds."""
    service, pool, clock = batches.service, batches.pool, batches.clock
    rng = random.Random(20)
    jobs = [f"job-{i:02d}" for i in range(40)]
    await batches.one_pull([NodeInventory(nodes=NODES)])
    for _ in range(6):
        known = sorted(service.book.placed) or jobs
        pull: list[Payload] = []
        for _ in range(40):
            job_id = rng.choice(jobs)
            roll = rng.random()
            at = T0 + timedelta(seconds=rng.randrange(0, 400))
            if roll < 0.4:
                pull.append(admitted(job_id, at=rng.randrange(0, 400, 7), gpus=rng.choice([1, 4, 8]),
                                     max_runtime_s=rng.choice([600, 3600]),
                                     priority=rng.choice(["low", "normal", "high"])))
            elif roll < 0.6:
                pull.append(JobStarted(job_id=rng.choice(known), started_at=at))
            elif roll < 0.8:
                pull.append(JobCompleted(job_id=rng.choice(known), finished_at=T0))
            elif roll < 0.9:
                pull.append(JobRequeued(job_id=job_id, spec=spec_of(job_id), resume_from=f"ckpt://{job_id}",
                                        submitted_at=T0))
            else:
                pull.append(JobCancelled(job_id=job_id, by="test"))
        clock.advance(10)
        await batches.one_pull(pull)
        assert service.book.view() == service.book.rebuilt()
        await memory_matches_the_tables(service, pool)
    assert service.book.placed and service.book.waiting, "the run should end with jobs both placed and waiting"


async def test_a_batch_failing_at_its_end_loses_and_duplicates_no_held_row(batches: Batches) -> None:
    """The batch's cycle fails after the held rows were written (as a crash before the commit would): the
    transaction rolls back with them, memory is rebuilt, the batch is handled again message by message, and every row
    and placement comes out once."""
    service, pool = batches.service, batches.pool
    cycle = service.cycle
    seen: list[int] = []

    async def failing_once(tx: Tx) -> None:
        await cycle(tx)
        if not seen:
            seen.append(await tx.conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE status = 'placed'"))
            raise RuntimeError("the batch's end fails")

    service.cycle = failing_once  # type: ignore[method-assign]
    seen.append(-1)  # the inventory's cycle passes
    await batches.one_pull([NodeInventory(nodes=NODES)])
    seen.clear()
    runtime = await batches.one_pull([admitted(f"j{i}", at=i) for i in range(3)])
    assert seen == [3]  # the three admissions' rows were written and placed before the failure
    assert runtime.counters.handled == 3
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE status = 'placed'") == 3
        assert await conn.fetchval("SELECT count(*) FROM scheduler.outbox WHERE subject LIKE '%.job.placed'") == 3
    await memory_matches_the_tables(service, pool)
