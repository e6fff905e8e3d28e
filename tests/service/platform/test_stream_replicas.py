"""Replicated streams, on a 3-node NATS cluster on loopback: gpuq creates its streams with GPUQ_STREAM_REPLICAS copies,
and never lowers what an operator raised: a stream given more replicas, a higher byte limit or no age limit by hand
keeps them across the next start of gpuq's declaration (ensure_streams), which says so in its log; a limit lowered
by hand is brought back to the declaration, and so is a stream without a byte limit (every stream stays bounded)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from shared.bus import REPLICAS_ENV, ensure_streams, kept_config, replicas_of, streams
from shared.servers import EmbeddedNats, free_port
from tests.support.nats_cluster import NatsCluster


@pytest_asyncio.fixture
async def cluster_js(tmp_path: Path) -> AsyncIterator[JetStreamContext]:
    cluster = NatsCluster(tmp_path / "nats")
    urls = await cluster.start()
    try:
        nc = await nats.connect(servers=urls)
        try:
            yield nc.jetstream()
        finally:
            await nc.close()
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
async def test_streams_are_created_with_the_replicas_asked_and_keep_what_an_operator_raised(
        cluster_js: JetStreamContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    js = cluster_js
    monkeypatch.setenv(REPLICAS_ENV, "3")
    await ensure_streams(js, purpose="test")
    for stream in streams():
        info = await js.stream_info(stream.name)
        assert info.config.num_replicas == 3, stream.name
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream.name  # 3 servers hold it

    # Streams declared with one replica (a gpuq started with the default) on a cluster where an operator raised
    # them: JOBS to 5 GiB more and no age limit, STATUS's byte limit lowered by hand, AUDIT left at 3 replicas.
    jobs, status, audit = (next(s for s in streams() if s.name.endswith(suffix))
                           for suffix in ("_JOBS", "_STATUS", "_AUDIT"))
    raised_bytes = jobs.max_bytes + 5 * 1024**3
    have = (await js.stream_info(jobs.name)).config
    await js.update_stream(config=_with(have, max_bytes=raised_bytes, max_age=0))
    have = (await js.stream_info(status.name)).config
    await js.update_stream(config=_with(have, max_bytes=status.max_bytes // 2))
    monkeypatch.setenv(REPLICAS_ENV, "1")
    with caplog.at_level(logging.INFO, logger="gpuq.bus"):
        await ensure_streams(js, purpose="test")

    got = (await js.stream_info(jobs.name)).config
    assert (got.num_replicas, got.max_bytes, got.max_age) == (3, raised_bytes, 0)
    assert (await js.stream_info(audit.name)).config.num_replicas == 3
    assert (await js.stream_info(status.name)).config.max_bytes == status.max_bytes  # lowered: brought back
    said = [r.getMessage() for r in caplog.records if "keeps what it was given" in r.getMessage()]
    jobs_said = next(m for m in said if jobs.name in m)
    assert "3 replicas (declared 1)" in jobs_said and f"max_bytes {raised_bytes}" in jobs_said \
        and "max_age none" in jobs_said
    assert any(audit.name in m and "3 replicas (declared 1)" in m for m in said)


def _with(config: StreamConfig, **fields: Any) -> StreamConfig:
    return replace(config, **fields)


def test_the_replica_count_is_checked_and_named() -> None:
    assert replicas_of("") == 1 and replicas_of(" 3 ") == 3
    for bad in ("0", "6", "three", "-1", "2.5"):
        with pytest.raises(ValueError, match=REPLICAS_ENV):
            replicas_of(bad)


def test_only_what_gives_more_room_is_kept() -> None:
    declared = StreamConfig(name="S", subjects=["s.>"], max_bytes=100, max_age=60.0, num_replicas=3)
    fewer = StreamConfig(name="S", subjects=["s.>"], max_bytes=50, max_age=30.0, num_replicas=1, max_msgs=7)
    wanted, kept = kept_config(fewer, declared)
    assert (wanted.num_replicas, wanted.max_bytes, wanted.max_age, wanted.max_msgs) == (3, 100, 60.0, 7)
    assert kept == []  # nothing above the declaration; what gpuq does not declare (max_msgs) stays
    more = StreamConfig(name="S", subjects=["s.>"], max_bytes=200, max_age=90.0, num_replicas=5)
    wanted, kept = kept_config(more, declared)
    assert (wanted.num_replicas, wanted.max_bytes, wanted.max_age) == (5, 200, 90.0)
    assert kept == ["5 replicas (declared 3)", "max_bytes 200 (declared 100)", "max_age 90 s (declared 60 s)"]
    # No age limit is kept; no byte limit is not: every stream stays bounded (a producer cannot fill the store).
    unbounded = StreamConfig(name="S", subjects=["s.>"], max_bytes=-1, max_age=0.0, num_replicas=3)
    wanted, kept = kept_config(unbounded, declared)
    assert (wanted.max_bytes, wanted.max_age, kept) == (100, 0.0, ["max_age none (declared 60 s)"])


@pytest.mark.timeout(60)
async def test_replicas_on_a_single_server_are_refused_saying_what_to_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    url = await asyncio.to_thread(server.start)
    try:
        nc = await nats.connect(url)
        try:
            monkeypatch.setenv(REPLICAS_ENV, "3")
            with pytest.raises(RuntimeError, match=f"not part of a cluster; set {REPLICAS_ENV}=1"):
                await ensure_streams(nc.jetstream(), purpose="test")
        finally:
            await nc.close()
    finally:
        await asyncio.to_thread(server.stop)
