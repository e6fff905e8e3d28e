"""The API's own documentation, over real HTTP from the running service: /docs and /redoc load only what the service
itself serves (they work with no network), /openapi.json types every body and answer, and a team's token is enough to
say the team and the queue of a submission."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import pytest_asyncio

from services.api import tokens
from shared.config import parse_queues
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER

# team-a: a namespace mapped, whose first queue is its default; team-b: one queue; team-c: two queues and no
# namespace, so no default.
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "a-batch", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 4}}},
               {"name": "a-main", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 4}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 4}}},
               {"name": "c-one", "teams": ["team-c"], "quotas": {"H100-80GB": {"nominal": 2}}},
               {"name": "c-two", "teams": ["team-c"], "quotas": {"H100-80GB": {"nominal": 2}}}],
    "namespaces": [{"name": "ml-a", "team": "team-a", "queues": ["a-main", "a-batch"]}],
}, "test queues")

# URLs in a page: attributes, and quoted absolute or root-relative URLs in its inline script (Swagger UI's `url:`).
URL_IN_PAGE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|["']((?:https?:)?//[^"']+|/[^"'\s]*)["']""")


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]
                   ) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("apidocs"), QUEUES, CLUSTER,
                            ("admission", "audit", "api")) as running:
        yield running


async def test_docs_and_redoc_load_only_what_the_service_serves(platform: ApiPlatform) -> None:
    host = urlsplit(platform.base).netloc
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        for page in ("/docs", "/redoc"):
            resp = await c.get(page)
            assert resp.status_code == 200 and "text/html" in resp.headers["content-type"], page
            urls = {a or b for a, b in URL_IN_PAGE.findall(resp.text)}
            assert len(urls) >= 2, f"{page} names no assets: {resp.text[:500]}"
            for url in sorted(urls):
                absolute = urljoin(platform.base + page, url)
                assert urlsplit(absolute).netloc == host, f"{page} loads {url} from another host"
                asset = await c.get(absolute)
                assert asset.status_code == 200 and asset.content, f"{page}: {url} answered {asset.status_code}"
            scripts = [u for u in urls if u.endswith(".js")]
            assert scripts, f"{page} loads no script of its own"
        # what the pages' scripts read: the document itself
        assert (await c.get("/openapi.json")).json()["info"]["title"] == "gpuq API"


async def test_openapi_types_every_request_and_answer(platform: ApiPlatform) -> None:
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        doc = (await c.get("/openapi.json")).json()
    components = doc["components"]["schemas"]

    def typed(schema: dict[str, Any]) -> bool:
        """A model with named fields, or a list of them (a bare `object` or `{}` is no type)."""
        if schema.get("type") == "array":
            return typed(schema.get("items") or {})
        if "anyOf" in schema:
            return all(typed(s) for s in schema["anyOf"])
        ref = schema.get("$ref")
        return isinstance(ref, str) and bool(components[ref.rsplit("/", 1)[-1]].get("properties"))

    # Actions whose whole input is the path and the query: nothing to put in a body.
    bodiless = {("post", "/v1/jobs/{job_id}/approve"), ("post", "/v1/webhooks/{sub_id}/rotate"),
                ("post", "/v1/webhooks/{sub_id}/enable")}
    untyped, without_body = [], []
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            answers = {code: r for code, r in op["responses"].items() if code.startswith("2")}
            assert answers, f"{method.upper()} {path} documents no 2xx answer"
            for code, answer in answers.items():
                schemas = [m.get("schema") or {} for m in answer.get("content", {}).values()]
                if not schemas or not all(typed(s) for s in schemas):
                    untyped.append(f"{method.upper()} {path} {code}")
            if method in ("post", "put", "patch") and "requestBody" not in op and (method, path) not in bodiless:
                without_body.append(f"{method.upper()} {path}")
    assert not untyped, f"answers without a schema: {untyped}"
    assert not without_body, f"no request body documented: {without_body}"
    # the submission's body: a spec whose team, queue and id the API may fill in
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert any(s.get("$ref", "").endswith("/JobRequest") for s in body["anyOf"])
    job = components["JobRequest"]
    assert {"pod_sets", "team", "queue", "job_id"} <= job["properties"].keys()
    assert not {"team", "queue", "job_id"} & set(job.get("required", []))
    status = components["JobStatus"]["properties"]
    assert {"job_id", "state", "queue", "eta"} <= status.keys()


def _bare(job_id: str | None = None, **fields: object) -> dict[str, object]:
    """A spec naming neither team nor queue."""
    spec: dict[str, object] = {"pod_sets": [{"count": 1, "gpus_per_pod": 1}], "max_runtime_s": 600, **fields}
    if job_id:
        spec["job_id"] = job_id
    return spec


async def test_the_team_and_its_default_queue_come_from_the_token(platform: ApiPlatform) -> None:
    tok = platform.tokens
    carol = (await tokens.issue(platform.conn, "carol", team="team-c")).token
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as c:
        # team-a: its namespace's first queue
        r = await c.post("/v1/jobs", json=_bare("a-bare"), headers=auth(tok["a"]))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
        row = await platform.conn.fetchrow("SELECT team, queue FROM admission.jobs WHERE job_id = 'a-bare'")
        assert (row["team"], row["queue"]) == ("team-a", "a-main")
        # a queue named is kept; an id left out is assigned, qualified with the token's team
        r = await c.post("/v1/jobs", json={"jobs": [_bare(queue="a-batch")]}, headers=auth(tok["a"]))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
        assigned = r.json()[0]["job_id"]
        assert assigned.startswith("team-a::")
        assert await platform.conn.fetchval("SELECT queue FROM admission.jobs WHERE job_id = $1", assigned) == "a-batch"
        # team-b: its only queue
        r = await c.post("/v1/jobs", json=_bare("b-bare"), headers=auth(tok["b"]))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
        assert await platform.conn.fetchval("SELECT queue FROM admission.jobs WHERE job_id = 'b-bare'") == "team-b"
        # team-c: two queues, no namespace: a 422 that names them
        r = await c.post("/v1/jobs", json=_bare("c-bare"), headers=auth(carol))
        assert r.status_code == 422, r.text
        assert "queue" in r.json()["detail"] and "c-one, c-two" in r.json()["detail"]
        # naming another team is refused as before, whether or not a queue is named
        for spec in (_bare("posing", team="team-b"), _bare("posing2", team="team-b", queue="team-b")):
            r = await c.post("/v1/jobs", json=spec, headers=auth(tok["a"]))
            assert r.status_code == 403 and "team-b" in r.json()["detail"], r.text
        # an admin's token has no team: the body names it (then its default queue applies)
        r = await c.post("/v1/jobs", json=_bare("admin-bare"), headers=auth(tok["admin"]))
        assert r.status_code == 422 and "team" in r.json()["detail"], r.text
        r = await c.post("/v1/jobs", json=_bare("admin-b", team="team-b"), headers=auth(tok["admin"]))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text


async def test_gpuq_submit_through_the_api_needs_no_team(platform: ApiPlatform) -> None:
    """`gpuq submit --gpus 1` with a team's token: the body leaves team, queue and id to the API, which takes the
    token's team, its default queue and an id qualified with the team."""
    from typer.testing import CliRunner

    from cli.main import app

    env = {"GPUQ_API_URL": platform.base, "GPUQ_TOKEN": platform.tokens["a"], "DATABASE_URL": "", "COLUMNS": "200"}
    res = await asyncio.to_thread(CliRunner().invoke, app, ["submit", "--gpus", "1", "--max-runtime", "600"], env=env)
    assert res.exit_code == 0, res.output
    assigned = re.search(r"submitted (team-a::\S+): queued", res.stdout)
    assert assigned, res.stdout
    row = await platform.conn.fetchrow("SELECT team, queue FROM admission.jobs WHERE job_id = $1", assigned[1])
    assert (row["team"], row["queue"]) == ("team-a", "a-main")
    # without a token (admin mode) a team is still needed
    res = await asyncio.to_thread(CliRunner().invoke, app, ["submit", "--gpus", "1"],
                                  env={"GPUQ_API_URL": "", "GPUQ_TOKEN": "", "DATABASE_URL": ""})
    assert res.exit_code == 2 and "--team" in res.output, res.output
