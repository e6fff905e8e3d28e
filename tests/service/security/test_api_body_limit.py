"""Request bodies are capped before anything buffers them (a 300 MB body once took the API to 1.25 GB): a declared
`Content-Length` over the cap is answered 413 without reading the body, and a chunked body is refused with 413
once what arrived passes the cap. Over real HTTP, against the API service listening on its port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

import httpx
import pytest
import pytest_asyncio

from services.api.limits import ENV_VAR
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER, QUEUES, job

CAP = 64 * 1024


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]],
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiPlatform]:
    monkeypatch.setenv(ENV_VAR, str(CAP))
    async with api_platform(auth_server, await make_database("bodylimit"), QUEUES, CLUSTER,
                            ("admission", "api")) as p:
        yield p


async def _raw_post(base: str, token: str, headers: str) -> bytes:
    """Send only a request's head (declaring a huge body, sending none of it) and read what the server answers."""
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write((f"POST /v1/jobs HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {token}\r\n"
                      f"Content-Type: application/json\r\n{headers}\r\n").encode())
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), timeout=10)
    finally:
        writer.close()


async def test_a_declared_body_over_the_cap_is_refused_unread(platform: ApiPlatform) -> None:
    answer = await _raw_post(platform.base, platform.tokens["a"], "Content-Length: 300000000\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request body too large: 300000000 bytes" in body and ENV_VAR.encode() in body
    answer = await _raw_post(platform.base, platform.tokens["a"], "Content-Length: 12abc\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


async def test_a_streamed_body_over_the_cap_is_refused_as_it_arrives(platform: ApiPlatform) -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer encoding
        nonlocal sent
        for _ in range(64):  # 4 MiB offered in all, 64 times the cap
            sent += 1
            yield b"[" + b" " * (64 * 1024 - 1)

    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        try:
            r = await c.post("/v1/jobs", content=chunks(), headers={**auth(platform.tokens["a"]),
                                                                     "Content-Type": "application/json"})
        except httpx.TransportError:  # the server may close before the client has written everything
            pytest.fail("the API closed the connection instead of answering 413")
        assert r.status_code == 413, r.text
        assert "request body too large: more than 65536 bytes" in r.json()["detail"]
        # A body within the cap still goes through.
        r = await c.post("/v1/jobs", json=job("small").model_dump(mode="json"), headers=auth(platform.tokens["a"]))
        assert r.status_code == 202, r.text
