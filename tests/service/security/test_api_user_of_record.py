"""The API stamps a job's user with the authenticated caller (per-user limits count it, issue 48): a job without a
user is the token's user's; a team's token naming another user is a 403 and nothing is published; an admin may
submit on a user's behalf. (Fails on the code before: the body's user was published as written.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest_asyncio

from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER, QUEUES, job


@pytest_asyncio.fixture
async def api(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("api_user_of_record"), QUEUES, CLUSTER,
                            ("api",)) as platform:
        yield platform


async def published_users(api: ApiPlatform) -> dict[str, str | None]:
    rows = await api.conn.fetch("SELECT body FROM api.outbox WHERE subject LIKE '%job.submitted%' ORDER BY seq")
    specs = [json.loads(bytes(r["body"]))["data"]["spec"] for r in rows]
    return {s["job_id"]: s.get("user") for s in specs}


async def test_the_user_is_the_callers_and_another_users_name_is_refused(api: ApiPlatform) -> None:
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        plain = await c.post("/v1/jobs?wait=0", json=job("a-1").model_dump(mode="json"), headers=auth(api.tokens["a"]))
        assert plain.status_code == 202, plain.text
        own = await c.post("/v1/jobs?wait=0", json=job("a-2", user="alice").model_dump(mode="json"),
                           headers=auth(api.tokens["a"]))
        assert own.status_code == 202, own.text
        other = await c.post("/v1/jobs?wait=0", json=job("a-3", user="bob").model_dump(mode="json"),
                             headers=auth(api.tokens["a"]))
        assert other.status_code == 403, other.text
        assert "names user 'bob'; this token submits as 'alice' only" in other.json()["detail"]
        on_behalf = await c.post("/v1/jobs?wait=0", json=job("a-4", user="bob").model_dump(mode="json"),
                                 headers=auth(api.tokens["admin"]))
        assert on_behalf.status_code == 202, on_behalf.text
    assert await published_users(api) == {"a-1": "alice", "a-2": "alice", "a-4": "bob"}
