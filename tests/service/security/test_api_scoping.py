"""The API service over real HTTP: each team sees and cancels only its own jobs; admins see everything; duplicates
and policy breaches are told to the submitter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import httpx
import pytest_asyncio

from tests.service.security.conftest import AuthServer, api_platform, wait_for
from tests.service.security.conftest import bearer as auth
from tests.service.security.test_attacks import CLUSTER, QUEUES, job


@pytest_asyncio.fixture
async def api(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]
              ) -> AsyncIterator[tuple[str, dict[str, str], asyncpg.Connection]]:
    async with api_platform(auth_server, await make_database("api"), QUEUES, CLUSTER,
                            ("admission", "scheduler", "executor", "audit", "api")) as platform:
        yield platform.base, platform.tokens, platform.conn


async def test_team_a_cannot_see_or_cancel_team_b_jobs(api: tuple[str, dict[str, str], asyncpg.Connection]) -> None:
    base, tok, conn = api
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        assert (await c.get("/v1/jobs")).status_code == 401
        assert (await c.get("/v1/jobs", headers=auth("gpuq_nope.nope"))).status_code == 401
        r = await c.post("/v1/jobs", json=job("b-secret", team="team-b", duration_s=36_000).model_dump(mode="json"),
                         headers=auth(tok["b"]))
        assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
        # team-a may not submit as team-b
        r = await c.post("/v1/jobs", json=job("posing", team="team-b").model_dump(mode="json"), headers=auth(tok["a"]))
        assert r.status_code == 403
        r = await c.post("/v1/jobs", json=job("a-mine", duration_s=36_000).model_dump(mode="json"),
                         headers=auth(tok["a"]))
        assert r.status_code == 202, r.text
        # scoping: team-a sees its job only; team-b's is "not found" to it, also for explain; a cancel of it is
        # answered as one of an id nobody submitted yet (admission refuses it: the job runs on, checked below)
        mine = {j["job_id"] for j in (await c.get("/v1/jobs", params={"all": True}, headers=auth(tok["a"]))).json()}
        assert mine == {"a-mine"}
        for path in ("/v1/jobs/b-secret", "/v1/jobs/b-secret/explain"):
            assert (await c.get(path, headers=auth(tok["a"]))).status_code == 404
        assert (await c.post("/v1/jobs/b-secret/cancel", headers=auth(tok["a"]))).status_code == 202
        everyone = {j["job_id"] for j in (await c.get("/v1/jobs", params={"all": True},
                                                      headers=auth(tok["admin"]))).json()}
        assert {"a-mine", "b-secret"} <= everyone
        # team-b's job still runs (team-a's cancel was refused); its own team cancels it
        await wait_for(lambda: conn.fetchval("SELECT true FROM audit.records WHERE action = 'cancel_refused' "
                                             "AND job_id = 'b-secret'"), what="team-a's cancel refused")
        await wait_for(lambda: conn.fetchval("SELECT status = 'running' FROM executor.runs WHERE job_id = 'b-secret'"),
                       what="team-b's job running")
        assert (await c.post("/v1/jobs/b-secret/cancel", headers=auth(tok["b"]))).status_code == 202
        await wait_for(lambda: conn.fetchval("SELECT outcome = 'Cancelled' FROM admission.jobs "
                                             "WHERE job_id = 'b-secret'"), what="the cancel")
        # the submitter is told about a duplicate id and a policy breach
        r = await c.post("/v1/jobs", json=job("a-mine").model_dump(mode="json"), headers=auth(tok["a"]))
        assert r.status_code == 409 and "DuplicateJobId" in r.json()["detail"]
        r = await c.post("/v1/jobs", json=job("a-big", gpus=16).model_dump(mode="json"), headers=auth(tok["a"]))
        assert r.status_code == 422 and "at most 8 per job" in r.json()["detail"]
        # audit: a team reads its own records only; the admin reads all, with authenticated actors
        await wait_for(lambda: conn.fetchval("SELECT count(*) > 0 FROM audit.records WHERE team = 'team-b'"),
                       what="team-b's audit records")
        teams = {r["team"] for r in (await c.get("/v1/audit", headers=auth(tok["a"]))).json()}
        assert teams == {"team-a"}
        actors = {r["actor"] for r in (await c.get("/v1/audit", headers=auth(tok["admin"]))).json()}
        assert {"token:alice", "token:mallory", "team:team-a", "team:team-b", "service:admission"} <= actors
        assert (await c.get("/openapi.json")).json()["info"]["title"] == "gpuq API"
        # approvals are for admins
        assert (await c.post("/v1/jobs/a-mine/approve", headers=auth(tok["a"]))).status_code == 403
