"""Embedded servers start, stop without orphans and fail clearly; the leader lease admits one instance."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import asyncpg
import nats
import pytest

from shared.leader import LeaderLease, LostLeadership
from shared.servers import EmbeddedNats, EmbeddedServerError


async def test_embedded_nats_runs_jetstream_and_stops_cleanly(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    proc = server._proc
    assert proc is not None
    nc = await nats.connect(url)
    info = await nc.jetstream().account_info()
    assert info.limits is not None  # JetStream answers
    await nc.close()
    server.stop()
    assert proc.poll() is not None  # no orphan process left behind
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)


def test_embedded_nats_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(EmbeddedServerError, match=f"port {port} .* already in use"):
            EmbeddedNats(tmp_path / "nats", port=port).start()


def test_embedded_nats_refuses_an_unusable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(EmbeddedServerError, match="cannot create the NATS data directory"):
        EmbeddedNats(blocker / "nats").start()


async def test_only_one_leader_and_fencing(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE SCHEMA IF NOT EXISTS plumbing_test")
    first = LeaderLease(database_url, "plumbing_test", "leader-test")
    second = LeaderLease(database_url, "plumbing_test", "leader-test")
    try:
        assert await first.try_acquire()
        assert not await second.try_acquire()  # the standby waits
        async with conn.transaction():
            await first.check_fence(conn)
        await first.release()  # the leader goes away (or its connection dies)
        term = await asyncio.wait_for(second.acquire(poll_s=0.05), timeout=10)
        assert term == (first.term or 0) + 1
        # The deposed leader's late write is refused by the fence.
        with pytest.raises(LostLeadership):
            async with conn.transaction():
                await first.check_fence(conn)
    finally:
        await first.release()
        await second.release()
        await conn.close()


async def test_shared_leases_coexist_and_exclude_the_exclusive_one(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE SCHEMA IF NOT EXISTS plumbing_test")
    one = LeaderLease(database_url, "plumbing_test", "shared-test", shared=True)
    two = LeaderLease(database_url, "plumbing_test", "shared-test", shared=True)
    sole = LeaderLease(database_url, "plumbing_test", "shared-test")
    try:
        assert await one.try_acquire() and await two.try_acquire()  # per-part instances run side by side
        assert one.term is None
        async with conn.transaction():
            await one.check_fence(conn)  # nothing to fence with
        assert not await sole.try_acquire()  # the whole-service instance waits for all of them
        await one.release()
        assert not await sole.try_acquire()
        await two.release()
        assert await asyncio.wait_for(sole.acquire(poll_s=0.05), timeout=10) >= 1
        assert not await one.try_acquire()  # and they wait for it
    finally:
        for lease in (one, two, sole):
            await lease.release()
        await conn.close()


async def test_release_frees_the_lock_even_when_the_lease_connection_is_busy(database_url: str) -> None:
    """On stop the watcher is cancelled, possibly in the middle of its liveness query on the lease connection;
    release must still give the lock back promptly so that a standby takes over."""
    first = LeaderLease(database_url, "plumbing_test", "busy-release-test")
    second = LeaderLease(database_url, "plumbing_test", "busy-release-test")
    assert await first.try_acquire()
    assert first._conn is not None
    busy = asyncio.create_task(first._conn.fetchval("SELECT pg_sleep(30)"))
    await asyncio.sleep(0.2)
    busy.cancel()  # what stop() does to the watcher: the query is cancelled, the connection left mid-operation
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(first.release(), timeout=15)
    assert asyncio.get_running_loop().time() - started < 12
    try:
        await asyncio.wait_for(second.acquire(poll_s=0.1), timeout=10)  # the lock was really given back
    finally:
        await second.release()
