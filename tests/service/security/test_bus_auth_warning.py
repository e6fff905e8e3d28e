"""A gpuq process pointed at a NATS that takes clients without credentials says so loudly (issue 43): a WARNING in
its log at start and `nats_auth` in the warnings of its /readyz report, without making it unready. Against the real
NATS of the test session (no users) and an authenticated nats-server started with the bus users' configuration."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.stack import Stack, StackSettings
from shared import busauth
from shared.config import parse_queues
from shared.health import HealthServer
from shared.natsauth import SERVICES
from shared.servers import EmbeddedNats, Servers
from tests.service.security.conftest import AuthServer, reset_streams, wait_for

QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}}],
})


async def readyz(stack: Stack) -> dict:  # type: ignore[type-arg]
    async with HealthServer(stack.health, host="127.0.0.1", port=0) as health, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{health.bound_port}", timeout=10) as client:
        async def ready() -> dict | None:  # type: ignore[type-arg]
            response = await client.get("/readyz")
            return response.json() if response.status_code == 200 else None

        body: dict = await wait_for(ready, what="/readyz ready")  # type: ignore[type-arg]
        return body


@pytest.fixture
def anonymous_bus(servers: Servers, fresh: tuple[str, str], tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A NATS that takes clients without credentials, and the session's database: the session's own bus when it has
    no users (NATS_URL, a container), else (the embedded server starts with the bus users) one of the test's own."""
    nats_url, database_url = fresh
    if servers.nats_auth is None:
        yield nats_url, database_url
        return
    own = EmbeddedNats(tmp_path / "nats")
    try:
        yield own.start(), database_url
    finally:
        own.stop()


async def test_a_bus_without_users_is_named_in_the_log_and_readyz(
        anonymous_bus: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    nats_url, database_url = anonymous_bus
    found = await busauth.probe(nats_url)
    assert found.anonymous is True and "accepts clients without credentials" in found.detail
    caplog.set_level(logging.WARNING, logger="gpuq.busauth")
    async with Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES,
                                   services=("audit",))) as stack:
        body = await readyz(stack)
    assert body["ready"] is True  # not a reason to be unready
    assert "anyone who can reach it can publish any fact" in body["warnings"][busauth.WARNING_KEY]
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "INSECURE BUS" in r.getMessage()]


async def test_a_bus_with_users_raises_no_warning(auth_server: AuthServer, database_url: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    # The admin's URL, as `gpuq up` gives it: the probe drops the credentials and is refused.
    found = await busauth.probe(auth_server.admin_url)
    assert found.anonymous is False and found.warning is None
    await reset_streams(auth_server.admin_url)
    caplog.set_level(logging.INFO, logger="gpuq.busauth")
    settings = StackSettings(nats_url=auth_server.admin_url, database_url=database_url, queues=QUEUES,
                             services=("audit",), nats_urls={s: auth_server.url(s) for s in SERVICES})
    async with Stack(settings) as stack:
        body = await readyz(stack)
    assert body["ready"] is True and body["warnings"] == {}
    # (the bus-auth check's own records: the test loop is shared by the session, and what another test's leftover
    # task logs meanwhile is not this check's warning)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "gpuq.busauth"]


async def test_an_unreachable_bus_is_not_called_insecure() -> None:
    found = await busauth.probe("nats://user:pw@127.0.0.1:9", timeout_s=1)
    assert found.anonymous is None and found.warning is None and "nats://127.0.0.1:9" in found.detail
    assert "pw" not in found.detail  # the probe never repeats the credentials
