"""The simulated executor's job path on real Postgres, fed the placements a real scheduler wrote: the placement
check and the job's earlier run come in one read (a placement starts once, however often it is delivered; a
resumed one keeps the work its checkpoint saved; a stale one is refused), and the runs that end in one tick are
written in one statement, with their events, or not at all."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import pytest
import pytest_asyncio

from services.executor.sim import DURATION_LABEL, FAILED_ATTEMPTS_LABEL, OUTCOME_LABEL, SimExecutor, SimExecutorSettings
from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_cluster
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import (
    CloudEvent,
    JobAdmitted,
    JobPreempted,
    JobRequeued,
    NodeInventory,
    Payload,
    PreemptionReason,
    encode_event,
    make_event,
    parse_event,
)
from shared.service import ServiceRuntime, Tx
from tests.service.scheduler.test_scheduler_service import T0

CLUSTER = parse_cluster({"node_groups": [{"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100",
                                          "cpu_milli": 64000, "memory_mib": 512000, "nodes_per_rack": 2}]})


@dataclass
class Path:
    clock: ManualClock
    scheduler: ServiceRuntime
    executor: SimExecutor
    runtime: ServiceRuntime
    conn: asyncpg.Connection

    async def to_scheduler(self, payload: Payload) -> None:
        raw = encode_event(make_event(payload, source="test", time=T0))
        assert await self.scheduler.handle(raw) == "handled"

    async def placements(self, job_id: str) -> list[bytes]:
        """The JobPlaced bodies the scheduler wrote for `job_id`, oldest first."""
        rows = await self.conn.fetch("SELECT body FROM scheduler.outbox WHERE subject LIKE '%.job.placed' "
                                     "ORDER BY seq")
        return [bytes(r["body"]) for r in rows if decode_event(bytes(r["body"])).subject == job_id]

    async def started(self, job_id: str) -> int:
        rows = await self.conn.fetch("SELECT body FROM executor.outbox WHERE subject LIKE '%.job.started'")
        return sum(1 for r in rows if decode_event(bytes(r["body"])).subject == job_id)

    async def run(self, job_id: str) -> asyncpg.Record:
        return await self.conn.fetchrow("SELECT * FROM executor.runs WHERE job_id = $1", job_id)


def decode_event(raw: bytes) -> CloudEvent:
    return parse_event(raw)[0]


def spec(job_id: str, **labels: str) -> JobSpec:
    return JobSpec(job_id=job_id, team="t", queue="t", max_runtime_s=3600, labels={DURATION_LABEL: "600", **labels},
                   pod_sets=(PodSet(count=1, gpus_per_pod=1),))


@pytest_asyncio.fixture
async def path(fresh: tuple[str, str]) -> AsyncIterator[Path]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    clock = ManualClock(T0.timestamp())
    scheduler = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=clock,
                               database_url=database_url)
    executor = SimExecutor(SimExecutorSettings(cluster=CLUSTER))
    runtime = ServiceRuntime(executor.spec(), nats_url=nats_url, pool=pool, clock=clock)
    await scheduler.start()
    await runtime.prepare()  # tables only: the test drives the executor's handlers and ticks itself
    conn = await asyncpg.connect(database_url)
    try:
        p = Path(clock, scheduler, executor, runtime, conn)
        await p.to_scheduler(NodeInventory(nodes=tuple(CLUSTER.nodes())))
        yield p
    finally:
        await conn.close()
        await runtime.stop()
        await scheduler.stop()
        await pool.close()


async def test_a_placement_starts_once_and_a_resumed_one_keeps_its_saved_work(path: Path) -> None:
    await path.to_scheduler(JobAdmitted(job_id="a", spec=spec("a"), flavors={"main": "H100"}, admitted_at=T0))
    [placed] = await path.placements("a")
    assert await path.runtime.handle(placed) == "handled"
    # The same placement again under a new message id (what an inbox cannot catch): nothing starts twice.
    again = json.loads(placed)
    again["id"] = "redelivered"
    assert await path.runtime.handle(json.dumps(again).encode()) == "handled"
    run = await path.run("a")
    assert run["status"] == "running" and run["attempt"] == 1 and await path.started("a") == 1
    assert run["ends_at"] == T0.timestamp() + 600

    # Preempted after a checkpoint that saved 120 s of work, requeued and placed again: it resumes.
    path.clock.advance(200)
    stop = JobPreempted(job_id="a", reason=PreemptionReason.PRIORITY, checkpoint_uri="ckpt://a",
                        preempted_at=T0 + timedelta(seconds=200))
    assert await path.runtime.handle(encode_event(make_event(stop, source="test", time=T0))) == "handled"
    await path.conn.execute("UPDATE executor.runs SET done_s = 120 WHERE job_id = 'a'")
    await path.to_scheduler(stop)
    await path.to_scheduler(JobRequeued(job_id="a", spec=spec("a"), resume_from="ckpt://a", submitted_at=T0))
    await path.to_scheduler(JobAdmitted(job_id="a", spec=spec("a"), flavors={"main": "H100"},
                                        admitted_at=T0 + timedelta(seconds=200)))
    first, second = await path.placements("a")
    assert decode_event(second).data["resume_from"] == "ckpt://a"
    # A placement that is not the scheduler's current one (other GPUs): refused, and the run is untouched.
    stale = json.loads(first)
    stale["id"] = "stale"
    binding = stale["data"]["bindings"][0]
    binding["gpu_indices"] = [(decode_event(second).data["bindings"][0]["gpu_indices"][0] + 1) % 8]
    assert await path.runtime.handle(json.dumps(stale).encode()) == "dead_letter"
    assert (await path.run("a"))["status"] == "preempted"
    assert await path.runtime.handle(second) == "handled"
    run = await path.run("a")
    assert run["status"] == "running" and run["attempt"] == 2 and run["done_s"] == 120
    assert run["ends_at"] == T0.timestamp() + 200 + 480  # the 600 s minus the 120 s saved
    assert await path.started("a") == 2
    reasons = [r["reason"] for r in await path.conn.fetch("SELECT reason FROM executor.dead_letters")]
    assert reasons == ["StalePlacement"]


async def test_the_runs_ending_in_one_tick_are_written_in_one_statement_or_not_at_all(path: Path) -> None:
    specs = [spec("ok-1"), spec("ok-2"), spec("oom", **{OUTCOME_LABEL: "OOMKilled", FAILED_ATTEMPTS_LABEL: "1"}),
             spec("later")]
    for s in specs:
        await path.to_scheduler(JobAdmitted(job_id=s.job_id, spec=s, flavors={"main": "H100"}, admitted_at=T0))
        [placed] = await path.placements(s.job_id)
        assert await path.runtime.handle(placed) == "handled"
    await path.conn.execute("UPDATE executor.runs SET ends_at = ends_at + 3000 WHERE job_id = 'later'")
    path.clock.advance(600)

    class Crash(Exception):
        pass

    # A crash after the tick's work, before its commit: nothing ended, no event written.
    with pytest.raises(Crash):
        async with path.conn.transaction():
            tx = Tx(conn=path.conn, now=path.clock.now(), source="test", schema="executor", buffered=True)
            await path.executor._finish_due(tx)
            await tx.flush()
            raise Crash
    assert {r["status"] for r in await path.conn.fetch("SELECT status FROM executor.runs")} == {"running"}
    assert await path.conn.fetchval("SELECT count(*) FROM executor.outbox WHERE subject LIKE '%.job.completed' "
                                    "OR subject LIKE '%.job.failed'") == 0

    statements: list[str] = []
    path.conn.add_query_logger(lambda record: statements.append(record.query))
    async with path.conn.transaction():
        tx = Tx(conn=path.conn, now=path.clock.now(), source="test", schema="executor", buffered=True)
        await path.executor._finish_due(tx)
        await tx.flush()
    path.conn.remove_query_logger(statements.append)
    rows = {r["job_id"]: (r["status"], r["outcome"], r["failures"])
            for r in await path.conn.fetch("SELECT job_id, status, outcome, failures FROM executor.runs")}
    assert rows == {"ok-1": ("completed", "Succeeded", 0), "ok-2": ("completed", "Succeeded", 0),
                    "oom": ("failed", "OOMKilled", 1), "later": ("running", None, 0)}
    assert sorted(e.type for e in tx.emitted) == ["io.gpuq.job.completed.v1", "io.gpuq.job.completed.v1",
                                                  "io.gpuq.job.failed.v1"]
    assert len([q for q in statements if q.lstrip().startswith("UPDATE executor.runs")]) == 1, statements
    # The next tick finds nothing more to end: each run ended once.
    async with path.conn.transaction():
        tx = Tx(conn=path.conn, now=path.clock.now(), source="test", schema="executor", buffered=True)
        await path.executor._finish_due(tx)
        assert tx.emitted == []
