"""Delivery guarantees of the shared runtime, proven against a real JetStream server and real Postgres."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio

from shared.bus import streams, takes_filter_subjects
from shared.clock import ManualClock
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import CloudEvent, JobCompleted, JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime, ServiceSpec, Tx, publish_event

SCHEMA = "plumbing_test"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def submitted(job_id: str) -> CloudEvent:
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=1),))
    return make_event(JobSubmitted(spec=spec), source="test", time=T0)


class CountingService:
    """A toy service: counts submissions per job and emits JobCompleted for each; can be told to crash."""

    def __init__(self) -> None:
        self.calls = 0
        self.crash_next = 0

    async def on_submitted(self, tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        self.calls += 1
        await tx.conn.execute(
            f"INSERT INTO {SCHEMA}.counts(job_id, n) VALUES ($1, 1) "
            "ON CONFLICT (job_id) DO UPDATE SET n = counts.n + 1", payload.spec.job_id)
        await tx.emit(JobCompleted(job_id=payload.spec.job_id, finished_at=T0))
        if self.crash_next > 0:
            self.crash_next -= 1
            raise RuntimeError("simulated crash before commit")

    def spec(self) -> ServiceSpec:
        return ServiceSpec(name="plumbingtest", schema=SCHEMA, handlers={JobSubmitted: self.on_submitted})


@pytest_asyncio.fixture
async def pool(fresh: tuple[str, str]) -> AsyncIterator[asyncpg.Pool]:
    _, db_url = fresh
    p = await create_pool(db_url)
    await p.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
    await p.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.counts(job_id text PRIMARY KEY, n int NOT NULL)")
    yield p
    await p.close()


async def count(pool: asyncpg.Pool, job_id: str) -> int:
    return await pool.fetchval(f"SELECT n FROM {SCHEMA}.counts WHERE job_id = $1", job_id) or 0


async def wait_for(predicate, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def stream_messages(nats_url: str, subject: str) -> list[dict]:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subject, ordered_consumer=True)
        out = []
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                break
            out.append({"body": json.loads(msg.data), "headers": msg.headers or {}})
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()


async def test_redelivered_event_changes_nothing_twice(fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    nats_url, _ = fresh
    svc = CountingService()
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.start()
    try:
        event = submitted("job-1")
        # The same event twice, with different Nats-Msg-Ids so JetStream's dedup does not hide the second:
        # this is what an ack lost after commit looks like to the consumer.
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        for msg_id in ("a", "b"):
            await js.publish(ns_subject("job.submitted.team-a"), encode_event(event), headers={"Nats-Msg-Id": msg_id})
        await nc.close()
        await wait_for(lambda: _eq(lambda: runtime.counters.duplicates, 1))
        assert await count(pool, "job-1") == 1
        assert svc.calls == 1
        await wait_for(lambda: _eq(lambda: runtime.counters.published, 1))
        completed = await stream_messages(nats_url, ns_subject("job.completed"))
        assert len(completed) == 1
    finally:
        await runtime.stop()


async def _eq(get, value) -> bool:  # type: ignore[no-untyped-def]
    return get() == value


async def test_handler_crash_before_commit_gets_event_again(fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    nats_url, _ = fresh
    svc = CountingService()
    svc.crash_next = 2
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.start()
    try:
        await publish_event(runtime.broker, submitted("job-2"), ns_subject("job.submitted.team-a"))
        await wait_for(lambda: _eq(lambda: runtime.counters.handled, 1))
        assert svc.calls == 3  # two crashed attempts, rolled back, then the one that committed
        assert runtime.counters.retried == 2
        assert await count(pool, "job-2") == 1
        await wait_for(lambda: _eq(lambda: runtime.counters.published, 1))
        # The rolled-back attempts left no outbox row behind: exactly one JobCompleted.
        assert len(await stream_messages(nats_url, ns_subject("job.completed"))) == 1
    finally:
        await runtime.stop()


async def test_publish_interrupted_after_commit_is_published_once_after_restart(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    nats_url, _ = fresh
    svc = CountingService()
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.prepare()
    # Commit a unit of work that emitted an event, without any relay running.
    async with pool.acquire() as conn, conn.transaction():
        tx = Tx(conn=conn, now=0.0, source="test", schema=SCHEMA)
        event = await tx.emit(JobCompleted(job_id="job-3", finished_at=T0))

    # First relay publishes, then "crashes" before marking the row published.
    published: list[str] = []
    original = runtime.publish_batch

    async def publish_then_crash(messages: Sequence[tuple[str, bytes, str]]) -> dict[str, str]:
        await original(messages)
        published.extend(event_id for _, _, event_id in messages)
        raise ConnectionError("process killed after publish, before marking the outbox row")

    runtime.publish_batch = publish_then_crash  # type: ignore[method-assign]  # the crash point under test
    with pytest.raises(ConnectionError):
        await runtime.relay_once()
    assert published == [event.id]
    assert await pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.outbox WHERE published_at IS NULL") == 1
    await runtime.stop()

    # Restart: a fresh runtime relays the row again; JetStream drops the copy by Nats-Msg-Id.
    restarted = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await restarted.prepare()
    assert await restarted.relay_once() == 1
    assert await restarted.relay_once() == 0
    await restarted.stop()
    messages = await stream_messages(nats_url, ns_subject("job.completed"))
    assert [m["body"]["id"] for m in messages] == [event.id]
    assert messages[0]["headers"].get("Nats-Msg-Id") == event.id


async def test_poison_messages_are_dead_lettered_with_reason(fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    nats_url, _ = fresh
    svc = CountingService()
    runtime = ServiceRuntime(svc.spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.start()
    try:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.publish(ns_subject("job.submitted.team-a"), b"{not json")
        unknown = submitted("job-4").model_copy(update={"type": "io.gpuq.job.teleported.v1"})
        await js.publish(ns_subject("job.submitted.team-a"), encode_event(unknown))
        bad = submitted("job-5").model_dump(mode="json")
        bad["data"]["spec"]["pod_sets"] = []
        await js.publish(ns_subject("job.submitted.team-a"), json.dumps(bad).encode())
        await publish_event(js, submitted("job-6"), ns_subject("job.submitted.team-a"))  # a good one after the bad ones
        await nc.close()
        await wait_for(lambda: _eq(lambda: runtime.counters.handled, 1))
        rows = await pool.fetch(f"SELECT reason, message FROM {SCHEMA}.dead_letters ORDER BY id")
        assert [r["reason"] for r in rows] == ["MalformedJson", "UnknownEventType", "InvalidPayload"]
        assert "pod_sets" in rows[2]["message"]
        dlq = await stream_messages(nats_url, ns_subject("dlq.plumbingtest"))
        assert [m["body"]["reason"] for m in dlq] == ["MalformedJson", "UnknownEventType", "InvalidPayload"]
        assert await count(pool, "job-6") == 1
    finally:
        await runtime.stop()


async def test_memory_is_rebuilt_after_a_failed_unit_of_work(fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """A handler that changed memory and then failed must not leave memory ahead of Postgres."""
    nats_url, _ = fresh
    seen: set[str] = set()  # the service's in-memory view of the counts table
    reloads = 0

    async def reload(conn: asyncpg.Connection) -> None:
        nonlocal reloads
        reloads += 1
        seen.clear()
        seen.update(r["job_id"] for r in await conn.fetch(f"SELECT job_id FROM {SCHEMA}.counts"))

    crash = {"job-7"}

    async def on_submitted(tx: Tx, event: CloudEvent, payload: JobSubmitted) -> None:
        seen.add(payload.spec.job_id)  # memory first, then the table, as the real services do
        if payload.spec.job_id in crash:
            crash.clear()
            raise RuntimeError("failed after touching memory")
        await tx.conn.execute(f"INSERT INTO {SCHEMA}.counts(job_id, n) VALUES ($1, 1)", payload.spec.job_id)

    spec = ServiceSpec(name="plumbingtest", schema=SCHEMA, handlers={JobSubmitted: on_submitted}, reload=reload)
    runtime = ServiceRuntime(spec, nats_url=nats_url, pool=pool, clock=ManualClock())
    await runtime.prepare()
    with pytest.raises(RuntimeError):
        await runtime.handle(encode_event(submitted("job-7")))
    assert seen == {"job-7"} and reloads == 0  # memory ran ahead of the rolled-back transaction...
    assert await runtime.handle(encode_event(submitted("job-8"))) == "handled"
    assert reloads == 1 and seen == {"job-8"}  # ...and was rebuilt from the tables before the next event
    await runtime.stop()


async def test_a_consumer_follows_the_handlers_filter_in_place_keeping_its_position(
        fresh: tuple[str, str], pool: asyncpg.Pool) -> None:
    """A service that handles fewer event types of a stream than when its consumer was made (several: their
    subjects on NATS >= 2.10, the stream's pattern on 2.9; one: its subject) has the consumer's filter narrowed at
    start, so the others are no longer delivered, and widened again when it handles more; the consumer keeps its
    position, so nothing is handled twice or lost. (`tests/service/plumbing/test_consumer_filters.py` runs the same
    on a NATS >= 2.10 of its own.)"""
    nats_url, _ = fresh
    await check_the_filter_follows_the_handlers(nats_url, pool)


def consumer_filters(config: Any) -> tuple[str, ...]:
    """A consumer's filters as the server reports them, `filter_subjects` (NATS >= 2.10) or `filter_subject`."""
    if config.filter_subjects:
        assert not config.filter_subject, "NATS takes filter_subject or filter_subjects, never both"
        return tuple(sorted(config.filter_subjects))
    return (config.filter_subject,) if config.filter_subject else ()


async def check_the_filter_follows_the_handlers(nats_url: str, pool: asyncpg.Pool) -> None:
    """The body of the test above, on the server of `nats_url` (2.9: one filter or the pattern; >= 2.10: one
    filter or `filter_subjects`, moving between the two both ways)."""
    svc = CountingService()
    ignored: list[str] = []

    async def on_completed(tx: Tx, event: CloudEvent, payload: JobCompleted) -> None:
        ignored.append(payload.job_id)

    def runtime(*, completed: bool) -> ServiceRuntime:
        handlers = {JobSubmitted: svc.on_submitted, **({JobCompleted: on_completed} if completed else {})}
        return ServiceRuntime(ServiceSpec(name="plumbingfilter", schema=SCHEMA, handlers=handlers), nats_url=nats_url,
                              pool=pool, clock=ManualClock())

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = next(s.name for s in streams() if s.name.endswith("_JOBS"))
    version = nc.connected_server_version
    wide_filters = tuple(sorted((JobCompleted.subscription(), JobSubmitted.subscription()))) \
        if takes_filter_subjects(version.major, version.minor) else (ns_subject("job.>"),)

    async def consumer() -> tuple[tuple[str, ...], int, int]:
        info = await js.consumer_info(stream, "plumbingfilter-job")
        return consumer_filters(info.config), info.delivered.consumer_seq, info.num_pending

    async def settled() -> bool:
        return (await consumer())[2] == 0 and svc.calls >= 1

    try:
        wide = runtime(completed=True)
        await wide.start()
        await publish_event(js, submitted("j1"), ns_subject("job.submitted.team-a"))  # emits JobCompleted(j1)
        await wait_for(lambda: _eq(lambda: ignored, ["j1"]))
        await wide.stop()
        assert (await consumer())[0] == wide_filters

        narrow = runtime(completed=False)
        await narrow.start()
        try:
            assert (await consumer())[0] == (JobSubmitted.subscription(),)
            await wait_for(settled)
            before = (await consumer())[1]
            for job_id in ("x1", "x2", "x3"):
                await publish_event(js, make_event(JobCompleted(job_id=job_id, finished_at=T0), source="test", time=T0),
                                    ns_subject("job.completed"))
            await publish_event(js, submitted("j2"), ns_subject("job.submitted.team-a"))
            await wait_for(lambda: _positive(count(pool, "j2")))
            await wait_for(settled)
            assert (await consumer())[1] - before == 1  # only j2's submission was delivered: no JobCompleted
            assert await count(pool, "j1") == 1  # its position was kept: nothing handled again
        finally:
            await narrow.stop()

        wide = runtime(completed=True)
        await wide.start()
        try:
            assert (await consumer())[0] == wide_filters
            await publish_event(js, make_event(JobCompleted(job_id="x4", finished_at=T0), source="test", time=T0),
                                ns_subject("job.completed"))
            await wait_for(lambda: _eq(lambda: ignored[-1:], ["x4"]))
            assert "x1" not in ignored  # from where it was: not the events published while it filtered narrower
        finally:
            await wide.stop()
    finally:
        await nc.close()


async def _positive(value) -> bool:  # type: ignore[no-untyped-def]
    return bool(await value)
