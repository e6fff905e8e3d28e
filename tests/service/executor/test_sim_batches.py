"""The simulated executor's placements in one consumed batch (services/executor/verify.py `placement_prefetch`,
services/executor/sim.py `RUNS_KEY`): one read checks every placement of the batch, the runs are written in one
round trip at its end, and a later message of the batch about one of those jobs (the same placement again, a cancel)
sees the run as if it had been written at once."""

from __future__ import annotations

import json

import asyncpg
import nats

from services.executor.sim import SimExecutor, SimExecutorSettings
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.db import create_pool
from shared.events import JobAdmitted, JobCancelled, NodeInventory, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from tests.service.executor.test_sim_job_path import CLUSTER, decode_event, spec
from tests.service.scheduler.test_scheduler_batches import logged_pool, until
from tests.service.scheduler.test_scheduler_service import T0


async def test_one_batch_of_placements_is_checked_in_one_read_and_its_runs_written_once(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    statements: list[str] = []
    executor_pool = await logged_pool(database_url, statements)
    clock = ManualClock(T0.timestamp())
    scheduler = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)
    await scheduler.start()
    executor = SimExecutor(SimExecutorSettings(cluster=CLUSTER))
    runtime = ServiceRuntime(executor.spec(), nats_url=nats_url, pool=executor_pool, clock=clock)
    nc = await nats.connect(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        for payload in (NodeInventory(nodes=tuple(CLUSTER.nodes())),
                        *(JobAdmitted(job_id=j, spec=spec(j), flavors={"main": "H100"}, admitted_at=T0)
                          for j in ("a", "b", "c"))):
            assert await scheduler.handle(encode_event(make_event(payload, source="test", time=T0))) == "handled"

        async def placements_published() -> bool:
            return await conn.fetchval("SELECT count(*) FROM scheduler.outbox WHERE subject LIKE '%.job.placed' "
                                       "AND published_at IS NOT NULL") == 3
        await until(placements_published)
        await scheduler.stop()  # its placements stay current: the cancel below is for the executor alone
        # Behind the three placements, on the bus: a cancel of c, and a's placement again under a new event id (what
        # an inbox cannot catch).
        bodies = [bytes(r["body"]) for r in await conn.fetch(
            "SELECT body FROM scheduler.outbox WHERE subject LIKE '%.job.placed'")]
        body = next(b for b in bodies if decode_event(b).subject == "a")
        again = json.loads(body)
        again["id"] = "a-again"
        js = nc.jetstream()
        cancel = make_event(JobCancelled(job_id="c", by="test"), source="test", time=T0)
        await js.publish(ns_subject("job.cancelled"), encode_event(cancel))
        await js.publish(ns_subject("job.placed"), json.dumps(again).encode())

        # The executor starts with the five messages waiting: one pull.
        await runtime.start()

        async def all_handled() -> bool:
            # the runtime counts a batch after its transaction committed and its connection went back to the pool
            # (an await): the committed rows alone can be seen before the count
            return (await conn.fetchval("SELECT count(*) FROM executor.inbox") == 5
                    and runtime.counters.batches + runtime.counters.batch_retries > 0)
        await until(all_handled)
        assert runtime.counters.batches == 1 and runtime.counters.batch_retries == 0
        runs = {r["job_id"]: (r["status"], r["attempt"]) for r in await conn.fetch(
            "SELECT job_id, status, attempt FROM executor.runs")}
        assert runs == {"a": ("running", 1), "b": ("running", 1), "c": ("cancelled", 1)}
        started = [decode_event(bytes(r["body"])).subject for r in await conn.fetch(
            "SELECT body FROM executor.outbox WHERE subject LIKE '%.job.started' ORDER BY seq")]
        assert started == ["a", "b", "c"]  # a's second placement started nothing
        reads = [q for q in statements if "LEFT JOIN scheduler.jobs j ON j.job_id = u.id" in q]
        assert len(reads) == 2, reads  # the batch's, and the second placement of a (after a's run was written)
        writes = [q for q in statements if q.lstrip().startswith("INSERT INTO executor.runs")]
        assert len(writes) == 1, writes
    finally:
        await runtime.stop()
        await scheduler.stop()
        await nc.close()
        await conn.close()
        await executor_pool.close()
        await pool.close()
