"""Consumption in batches on a real JetStream server and Postgres: a pulled batch is handled in one transaction, one
savepoint per message, so a poison message or a failing handler in the middle of a batch costs only itself; and an
event that arrives before the event it depends on (a cancel before the admission) is still handled right."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import nats
import pytest
import pytest_asyncio

from services.scheduler.app import SchedulerService
from shared.clock import ManualClock
from shared.config import parse_cluster
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import CloudEvent, JobAdmitted, JobCancelled, JobSubmitted, NodeInventory, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import Refused, ServiceRuntime, Tx, publish_event
from tests.service.plumbing.test_delivery import SCHEMA, CountingService, count, submitted, wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest_asyncio.fixture
async def pool(fresh: tuple[str, str]) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(fresh[1])
    await p.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")  # this module's own schema, from an earlier test
    await p.execute(f"CREATE SCHEMA {SCHEMA}")
    await p.execute(f"CREATE TABLE {SCHEMA}.counts(job_id text PRIMARY KEY, n int NOT NULL)")
    yield p
    await p.close()


@pytest.mark.parametrize("optimistic", [False, True], ids=["savepoints", "optimistic"])
async def test_poison_and_a_failing_handler_in_the_middle_of_a_batch_cost_only_themselves(
        fresh: tuple[str, str], pool: asyncpg.Pool, optimistic: bool) -> None:
    """With a savepoint per message, the failing message alone rolls back and is retried. With optimistic batches
    (no savepoints), the failure rolls the whole batch back, memory is rebuilt, and the batch is handled again
    with savepoints: still every job counted once and every JobCompleted emitted once."""
    nats_url, _ = fresh
    svc = CountingService()
    failed: list[str] = []
    reloads: list[int] = []

    async def fails_once_for_one_job(tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        await svc.on_submitted(tx, event, payload)  # its row and its JobCompleted, rolled back with the failure
        if payload.spec.job_id == "fails-once" and not failed:
            failed.append(payload.spec.job_id)
            raise RuntimeError("simulated failure of one message in the middle of the batch")

    async def reload(conn: asyncpg.Connection) -> None:
        reloads.append(1)

    spec = svc.spec()
    spec.handlers = {JobSubmitted: fails_once_for_one_job}
    spec.optimistic_batches = optimistic
    spec.reload = reload
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    subject = ns_subject("job.submitted.team-a")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    # All on the stream before the service starts: its first pull takes them as one batch.
    for i in range(5):
        await publish_event(js, submitted(f"before-{i}"), subject)
    await js.publish(subject, b"{poison")
    await publish_event(js, submitted("fails-once"), subject)
    for i in range(5):
        await publish_event(js, submitted(f"after-{i}"), subject)
    await nc.close()
    await runtime.start()
    try:
        await wait_for(lambda: _all_counted(pool, 11))
        for job in [*(f"before-{i}" for i in range(5)), *(f"after-{i}" for i in range(5)), "fails-once"]:
            assert await count(pool, job) == 1, job  # once each: the failed attempt rolled back its own savepoint
        rows = await pool.fetch(f"SELECT reason, stream_seq FROM {SCHEMA}.dead_letters")
        assert [r["reason"] for r in rows] == ["MalformedJson"] and rows[0]["stream_seq"] == 6
        assert runtime.counters.handled == 11 and runtime.counters.dead_lettered == 1
        if optimistic:  # the batch was handled again, with savepoints, where the handler no longer failed
            assert runtime.counters.batch_retries == 1 and runtime.counters.retried == 0
        else:
            assert runtime.counters.batch_retries == 0 and runtime.counters.retried == 1
        assert reloads  # memory rebuilt after the rollback (of the message, or of the whole batch)
        # the good ten of the first batch were committed together (the retry came in a later one)
        assert 1 <= runtime.counters.batches <= 3
        # every JobCompleted the handler emitted once, none from the rolled-back attempt twice
        assert await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.outbox") == 11
    finally:
        await runtime.stop()


async def test_a_refusal_in_an_optimistic_batch_dead_letters_that_message_alone(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """A handler that refuses its event in a batch handled without savepoints: the batch rolls back and is handled
    again with savepoints, the refused event is dead-lettered (its inbox row not kept), the others are counted
    and emitted once, in order; the next batches use savepoints too."""
    nats_url, _ = fresh
    svc = CountingService()

    async def refuses_one(tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        await svc.on_submitted(tx, event, payload)
        if payload.spec.job_id == "refused":
            raise Refused("NotForUs", "refused in the middle of the batch")

    spec = svc.spec()
    spec.handlers = {JobSubmitted: refuses_one}
    spec.optimistic_batches = True
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    subject = ns_subject("job.submitted.team-a")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    names = [*(f"before-{i}" for i in range(3)), "refused", *(f"after-{i}" for i in range(3))]
    for name in names:
        await publish_event(js, submitted(name), subject)
    await nc.close()
    await runtime.start()
    try:
        await wait_for(lambda: _all_counted(pool, 6))
        await wait_for(lambda: _dead(runtime, 1))
        for job in names:
            assert await count(pool, job) == (0 if job == "refused" else 1), job
        rows = await pool.fetch(f"SELECT reason FROM {SCHEMA}.dead_letters")
        assert [r["reason"] for r in rows] == ["NotForUs"]
        order = [json.loads(bytes(r["body"]))["data"]["job_id"]
                 for r in await pool.fetch(f"SELECT body FROM {SCHEMA}.outbox ORDER BY seq")]
        assert order == [n for n in names if n != "refused"]
        assert await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.inbox") == 6
        assert runtime.counters.batch_retries == 1 and runtime.counters.handled == 6
    finally:
        await runtime.stop()


async def _dead(runtime: ServiceRuntime, n: int) -> bool:
    return runtime.counters.dead_lettered >= n


async def test_a_batch_writes_each_message_once_in_order_and_a_copy_in_the_same_batch_is_a_duplicate(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """A batch claims its inbox rows, writes its outbox rows and its job trace rows together (one statement each,
    not one per message): each event is still handled once, a second copy of an event in the same pull is a
    duplicate, the outbox keeps the handling order, and every job's trace row is written once."""
    nats_url, _ = fresh
    svc = CountingService()
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    subject = ns_subject("job.submitted.team-a")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    copied = submitted("copied")
    for i in range(3):
        await publish_event(js, submitted(f"job-{i}"), subject)
    await publish_event(js, copied, subject)
    await js.publish(subject, encode_event(copied))  # a second copy, past JetStream's dedup (no Nats-Msg-Id)
    for i in range(3, 6):
        await publish_event(js, submitted(f"job-{i}"), subject)
    await nc.close()
    await runtime.start()
    try:
        await wait_for(lambda: _all_counted(pool, 7))
        await wait_for(lambda: _settled(runtime, 8))
        assert await count(pool, "copied") == 1
        assert runtime.counters.handled == 7 and runtime.counters.duplicates == 1
        order = [json.loads(bytes(r["body"]))["data"]["job_id"]
                 for r in await pool.fetch(f"SELECT body FROM {SCHEMA}.outbox ORDER BY seq")]
        assert order == ["job-0", "job-1", "job-2", "copied", "job-3", "job-4", "job-5"]
        traces = await pool.fetch(f"SELECT job_id FROM {SCHEMA}.job_traces ORDER BY job_id")
        assert [r["job_id"] for r in traces] == sorted(["copied", *(f"job-{i}" for i in range(6))])
        assert await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.inbox") == 7
    finally:
        await runtime.stop()


async def _settled(runtime: ServiceRuntime, n: int) -> bool:
    c = runtime.counters
    return c.handled + c.duplicates >= n


async def _all_counted(pool: asyncpg.Pool, n: int) -> bool:
    return (await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.counts")) == n


def _admitted(job_id: str) -> bytes:
    spec = JobSpec(job_id=job_id, team="t", queue="t", pod_sets=(PodSet(count=1, gpus_per_pod=1),))
    return encode_event(make_event(JobAdmitted(job_id=job_id, spec=spec, flavors={"main": "H100"}, admitted_at=T0),
                                   source="test", time=T0))


async def test_a_cancel_that_arrives_before_the_admission_still_cancels(fresh: tuple[str, str]) -> None:
    """The early-cancel race: admission's JobCancelled for a job can reach the scheduler before the JobAdmitted it
    published earlier was handled (another consumer's order, a redelivery). The cancel leaves a tombstone; the late
    admission meets it and is not placed. Both arrive in one batch here, after the cancel."""
    nats_url, database_url = fresh
    nodes = tuple(parse_cluster({"node_groups": [
        {"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 64000,
         "memory_mib": 512000}]}).nodes())
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.publish(ns_subject("node.inventory"),
                     encode_event(make_event(NodeInventory(nodes=nodes), source="test", time=T0)))
    cancel = make_event(JobCancelled(job_id="early", by="admission"), source="test", time=T0)
    await js.publish(ns_subject("job.cancelled"), encode_event(cancel))
    await js.publish(ns_subject("job.admitted"), _admitted("early"))
    await js.publish(ns_subject("job.admitted"), _admitted("other"))
    await nc.close()
    pool = await create_pool(database_url)
    runtime = ServiceRuntime(SchedulerService().spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url)
    await runtime.start()
    try:
        async def other_placed() -> bool:
            return await pool.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'other'") == "placed"

        await wait_for(other_placed)
        await asyncio.sleep(0.5)
        assert await pool.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'early'") is None
        assert await pool.fetchval("SELECT count(*) FROM scheduler.cancelled WHERE job_id = 'early'") == 1
        assert runtime.counters.dead_lettered == 0
    finally:
        await runtime.stop()
        await pool.close()


@pytest.mark.parametrize("linger_s", [0.0, 1.0], ids=["no-linger", "linger"])
async def test_a_lingering_consumer_takes_what_came_soon_after_the_first_message_in_the_same_batch(
        fresh: tuple[str, str], pool: asyncpg.Pool, linger_s: float) -> None:
    """`ServiceSpec.batch_linger_s`: one submission reaches an idle consumer, four more follow 0.2 s later. A
    lingering consumer handles the five as one batch; one that does not linger handles the first alone."""
    nats_url, _ = fresh
    svc = CountingService()
    spec = svc.spec()
    spec.batch_linger_s = linger_s
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    subject = ns_subject("job.submitted.team-a")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await runtime.start()
    try:
        await asyncio.sleep(0.3)  # the consumer is idle: its pull waits on the server
        await publish_event(js, submitted("first"), subject)
        await asyncio.sleep(0.2)
        for i in range(4):
            await publish_event(js, submitted(f"soon-{i}"), subject)
        await wait_for(lambda: _all_counted(pool, 5))
        batches = runtime.counters.batches
        assert batches == 1 if linger_s else batches >= 2
    finally:
        await runtime.stop()
        await nc.close()
