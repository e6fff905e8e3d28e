"""The API refuses what Postgres cannot store (issue 43): a NUL character or a lone surrogate anywhere in a submitted
spec is a 422 naming the field, never a 500, and nothing is published for it (admission would only fail on it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER, QUEUES, job


@pytest_asyncio.fixture
async def api(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("api_unstorable"), QUEUES, CLUSTER, ("api",)) as platform:
        yield platform


def spec_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = job("a-1").model_dump(mode="json")
    doc.update(changes)
    return doc


@pytest.mark.parametrize(("doc", "named"), [
    (spec_doc(labels={"team": "a\u0000b"}), "labels.team: contains a NUL"),
    (spec_doc(labels={"te\u0000am": "ab"}), "labels: key 'te\\x00am': contains a NUL"),
    (spec_doc(user="mallory\u0000"), "user: contains a NUL"),
    ({"jobs": [spec_doc(job_id="a-2"), spec_doc(datasets=["imagenet\u0000"])]}, "datasets[0]: contains a NUL"),
], ids=["label-value", "label-key", "user", "second-of-two"])
async def test_a_nul_in_a_submitted_spec_is_a_422_naming_the_field(api: ApiPlatform, doc: dict[str, Any],
                                                                     named: str) -> None:
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        r = await c.post("/v1/jobs", json=doc, headers=auth(api.tokens["a"]))
    assert r.status_code == 422, r.text
    assert named in r.json()["detail"], r.json()["detail"]
    assert await api.conn.fetchval("SELECT count(*) FROM api.outbox WHERE subject LIKE '%job.submitted%'") == 0


async def test_a_lone_surrogate_in_a_submitted_spec_is_a_422_naming_the_field(api: ApiPlatform) -> None:
    body = json.dumps(spec_doc(labels={"x": "PLACEHOLDER"})).replace("PLACEHOLDER", "\\ud800").encode()
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        r = await c.post("/v1/jobs", content=body, headers={**auth(api.tokens["a"]),
                                                            "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert "labels.x: contains a lone surrogate" in r.json()["detail"]
    assert await api.conn.fetchval("SELECT count(*) FROM api.outbox WHERE subject LIKE '%job.submitted%'") == 0


@pytest.mark.parametrize(("body", "named"), [
    (b"[" * 5000 + b"]" * 5000, "nests deeper than"),
    (b'{"labels": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}", "nests deeper than"),
    (b'{"job_id": "a-9", ', "is not JSON"),
], ids=["deep-array", "deep-object", "truncated"])
async def test_a_hostile_or_broken_body_is_a_422_not_a_500(api: ApiPlatform, body: bytes, named: str) -> None:
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        r = await c.post("/v1/jobs", content=body, headers={**auth(api.tokens["a"]),
                                                            "Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert named in r.json()["detail"], r.json()["detail"]
        # the API still serves the next request
        assert (await c.get("/v1/jobs", headers=auth(api.tokens["a"]))).status_code == 200
    assert await api.conn.fetchval("SELECT count(*) FROM api.outbox WHERE subject LIKE '%job.submitted%'") == 0
