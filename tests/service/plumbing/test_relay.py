"""The outbox relay against a real JetStream server and Postgres: rows publish in pipelined batches, a row that can
never be published is dead-lettered with its reason instead of wedging the rows behind it, and old rows are pruned."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
import pytest_asyncio

from shared.clock import ManualClock
from shared.db import create_pool
from shared.domain import NodeSpec
from shared.events import JobCompleted, NodeInventory
from shared.namespace import subject as ns_subject
from shared.service import RELAY_BATCH, ServiceRuntime, ServiceSpec, Tx, retention_from_env
from tests.service.plumbing.test_delivery import stream_messages

SCHEMA = "relay_test"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _spec() -> ServiceSpec:
    return ServiceSpec(name="relaytest", schema=SCHEMA, handlers={})


@pytest_asyncio.fixture
async def runtime(fresh: tuple[str, str]) -> AsyncIterator[ServiceRuntime]:
    nats_url, db_url = fresh
    pool = await create_pool(db_url)
    await pool.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")  # this test's own schema, from an earlier test
    rt = ServiceRuntime(_spec(), nats_url=nats_url, pool=pool, clock=ManualClock())
    await rt.prepare()  # no relay loop: the test drives relay_once itself
    yield rt
    await rt.stop()
    await pool.close()


async def _emit(rt: ServiceRuntime, *payloads: JobCompleted | NodeInventory) -> list[str]:
    async with rt.pool.acquire() as conn, conn.transaction():
        tx = Tx(conn=conn, now=0.0, source="test", schema=SCHEMA)
        return [(await tx.emit(p)).id for p in payloads]


def _inventory(nodes: int) -> NodeInventory:
    return NodeInventory(nodes=tuple(
        NodeSpec(name=f"node-{i:05d}", gpus=8, gpu_model="H100-80GB", cpu_milli=192_000, memory_mib=2_000_000,
                 rack=f"rack-{i // 32:03d}", block=f"block-{i // 512:02d}",
                 labels={"topology.kubernetes.io/zone": "zone-a"}) for i in range(nodes)))


async def _dead_letters(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch(f"SELECT subject, reason, message, length(body) AS size FROM {SCHEMA}.dead_letters "
                            "ORDER BY id")


async def test_relay_publishes_a_batch_in_order(fresh: tuple[str, str], runtime: ServiceRuntime) -> None:
    ids = await _emit(runtime, *(JobCompleted(job_id=f"job-{i:03d}", finished_at=T0) for i in range(300)))
    assert await runtime.relay_once() == 300
    assert await runtime.relay_once() == 0
    messages = await stream_messages(fresh[0], ns_subject("job.completed"))
    assert [m["body"]["id"] for m in messages] == ids
    assert [m["headers"]["Nats-Msg-Id"] for m in messages] == ids


async def test_a_row_committed_while_the_relay_queries_is_published_without_waiting_for_the_poll(
        fresh: tuple[str, str], runtime: ServiceRuntime) -> None:
    """A unit of work that commits after the relay's query found nothing, but before the relay waits, must wake it:
    its wake-up may not be cleared after the query (a lost wake-up: the row would wait for the poll interval)."""
    runtime.relay_poll_s = 3600.0  # a lost wake-up waits this long: the bounded wait below fails instead
    real_relay_once = runtime.relay_once
    calls: list[int] = []
    emitted: list[str] = []

    async def relay_once_with_a_commit_after_the_query(limit: int = RELAY_BATCH) -> int:
        settled = await real_relay_once(limit)
        calls.append(settled)
        if len(calls) == 1:
            assert settled == 0  # nothing to publish yet; the commit lands just after the query
            async with runtime.transaction() as tx:
                emitted.append((await tx.emit(JobCompleted(job_id="job-raced", finished_at=T0))).id)
        return settled

    runtime.relay_once = relay_once_with_a_commit_after_the_query  # type: ignore[method-assign]
    relay = asyncio.create_task(runtime._relay_loop())
    try:
        async def published() -> None:
            # The second query returned (its commit alone could be seen before relay_once has returned).
            while len(calls) < 2 or await runtime.pool.fetchval(
                    f"SELECT count(*) FROM {SCHEMA}.outbox WHERE published_at IS NULL"):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(published(), timeout=30)  # far below the poll interval, far above any real delay
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
    assert calls[:2] == [0, 1]  # the second query, woken at once, published the row
    assert [m["body"]["id"] for m in await stream_messages(fresh[0], ns_subject("job.completed"))] == emitted


async def test_relay_dead_letters_an_oversize_row_and_publishes_the_rows_behind_it(
        fresh: tuple[str, str], runtime: ServiceRuntime) -> None:
    big = _inventory(6000)  # one event for a 6,000-node cluster: well above NATS's default 1 MiB max_payload
    before, _, after = await _emit(runtime, JobCompleted(job_id="job-before", finished_at=T0), big,
                                   JobCompleted(job_id="job-after", finished_at=T0))
    body_size = await runtime.pool.fetchval(f"SELECT length(body) FROM {SCHEMA}.outbox WHERE subject = $1",
                                            ns_subject("node.inventory"))
    assert body_size > 1024 * 1024
    assert await runtime.relay_once() == 3
    assert [m["body"]["id"] for m in await stream_messages(fresh[0], ns_subject("job.completed"))] == [before, after]
    assert await stream_messages(fresh[0], ns_subject("node.inventory")) == []
    [dead] = await _dead_letters(runtime.pool)
    assert dead["reason"] == "OutboxOversize" and dead["subject"] == ns_subject("node.inventory")
    assert dead["size"] == body_size and "bytes" in dead["message"]  # the whole body is kept in the table
    assert await runtime.pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.outbox WHERE published_at IS NULL") == 0
    # the bus notice carries the reason and a cut body
    [notice] = await stream_messages(fresh[0], ns_subject("dlq.relaytest"))
    assert notice["body"]["reason"] == "OutboxOversize" and notice["body"]["body_bytes"] == body_size
    assert runtime.counters.published == 2 and runtime.counters.dead_lettered == 1


async def test_relay_dead_letters_a_row_no_stream_captures(fresh: tuple[str, str], runtime: ServiceRuntime) -> None:
    [good] = await _emit(runtime, JobCompleted(job_id="job-1", finished_at=T0))
    # A row written for a subject no stream of this namespace captures (an older build's subject, a typo).
    await runtime.pool.execute(f"INSERT INTO {SCHEMA}.outbox(event_id, subject, body) VALUES ('poison', $1, $2)",
                               ns_subject("nowhere.at.all"), b"{}")
    assert await runtime.relay_once() == 2
    [dead] = await _dead_letters(runtime.pool)
    assert dead["reason"] == "OutboxNoStream" and "nowhere.at.all" in dead["message"]
    assert [m["body"]["id"] for m in await stream_messages(fresh[0], ns_subject("job.completed"))] == [good]
    assert await runtime.relay_once() == 0


async def test_prune_removes_old_published_and_inbox_rows_only(runtime: ServiceRuntime) -> None:
    await _emit(runtime, JobCompleted(job_id="job-1", finished_at=T0))
    assert await runtime.relay_once() == 1
    await _emit(runtime, JobCompleted(job_id="job-2", finished_at=T0))  # committed, not yet published
    await runtime.pool.execute(f"INSERT INTO {SCHEMA}.inbox(event_id, type, handled_at) VALUES "
                               "('old', 't', now() - interval '8 days'), ('new', 't', now())")
    await runtime.pool.execute(f"UPDATE {SCHEMA}.outbox SET published_at = now() - interval '8 days' "
                               "WHERE published_at IS NOT NULL")
    assert await runtime.prune_once() == (1, 1)  # the default retention is 7 days
    assert await runtime.pool.fetchval(f"SELECT count(*) FROM {SCHEMA}.outbox WHERE published_at IS NULL") == 1
    assert [r["event_id"] for r in await runtime.pool.fetch(f"SELECT event_id FROM {SCHEMA}.inbox")] == ["new"]
    assert await runtime.prune_once() == (0, 0)


def test_retention_setting_is_checked() -> None:
    assert retention_from_env({}) == 7 * 86_400
    assert retention_from_env({"GPUQ_PLUMBING_RETENTION_S": "7200"}) == 7200
    with pytest.raises(ValueError, match="GPUQ_PLUMBING_RETENTION_S='60' is below"):
        retention_from_env({"GPUQ_PLUMBING_RETENTION_S": "60"})
    with pytest.raises(ValueError, match="not a number"):
        retention_from_env({"GPUQ_PLUMBING_RETENTION_S": "a week"})


@pytest.mark.parametrize("rows", [2, RELAY_BATCH + 1])
async def test_the_relay_asks_again_at_once_only_after_a_full_batch(runtime: ServiceRuntime, rows: int) -> None:
    """A pass that took fewer rows than it may saw everything committed before its query (later commits wake the
    loop), so the loop waits instead of running an empty pass after every publishing one; a full pass may have left
    rows behind and is followed by another at once."""
    runtime.relay_poll_s = 3600.0  # an extra pass can only come from the loop itself, not from the poll
    async with runtime.transaction() as tx:
        for i in range(rows):
            await tx.emit(JobCompleted(job_id=f"job-{i}", finished_at=T0))
    real_relay_once = runtime.relay_once
    calls: list[int] = []

    async def counted(limit: int = RELAY_BATCH) -> int:
        calls.append(await real_relay_once(limit))
        return calls[-1]

    runtime.relay_once = counted  # type: ignore[method-assign]
    relay = asyncio.create_task(runtime._relay_loop())
    try:
        async def published() -> None:
            while sum(calls) < rows:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(published(), timeout=30)
        await asyncio.sleep(0.5)  # an extra pass, if the loop ran one, has happened by now
        expected = [rows] if rows < RELAY_BATCH else [RELAY_BATCH, rows - RELAY_BATCH]
        assert calls == expected
        async with runtime.transaction() as tx:  # a later commit wakes the loop: published without the poll
            await tx.emit(JobCompleted(job_id="job-later", finished_at=T0))
        while len(calls) <= len(expected):
            await asyncio.sleep(0.05)
        assert calls == [*expected, 1]
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay


async def test_the_relay_stops_when_its_pool_is_closed_under_it(fresh: tuple[str, str],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A runtime whose owner closed its pool without stopping it: its relay loop ends with one warning instead of
    logging a failure every second for the life of the process (seen from a test's leftover runtime)."""
    pool = await create_pool(fresh[1])
    rt = ServiceRuntime(_spec(), nats_url=fresh[0], pool=pool, clock=ManualClock())
    await rt.prepare()
    rt.relay_poll_s = 0.05
    relay = asyncio.create_task(rt._relay_loop())
    try:
        await pool.close()
        await asyncio.wait_for(asyncio.shield(relay), timeout=30)  # it returns: a retrying loop would time out
    finally:
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
        await rt.stop()
    assert [r.getMessage() for r in caplog.records if "relaytest: outbox relay" in r.getMessage()] == [
        "relaytest: outbox relay stops: its database pool is closed"]
