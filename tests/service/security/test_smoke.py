"""`gpuq smoke`, the script the chart's `helm test` pod runs (deploy/helm/gpuq/templates/tests/smoke.yaml: the same
command and flags), against a running platform with the API: it mints a team token for the run (DATABASE_URL), submits
a 1-GPU job through the API, waits until it is placed (a cluster with GPUs) or admitted (one without: here, a GPU
model the queue has quota for and no node has), and leaves nothing behind: the job cancelled, the token revoked. A
run that fails cleans up the same and says what it saw."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest_asyncio
from click.testing import Result
from typer.testing import CliRunner

from cli.main import app
from services.api.readmodel import fetch_status
from services.executor.sim import DURATION_LABEL
from shared.config import parse_queues
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform, bearer
from tests.service.security.test_attacks import CLUSTER

# team-a may use H100-80GB, which the cluster has, and B200, which no node has: a job for B200 is admitted and never
# placed, as any job is on a cluster without GPUs. (A job for any model is given B200's quota first: the placed runs
# name H100-80GB.)
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}, "B200": {"nominal": 8}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}}],
}, "smoke queues")
# The helm test pod's flags (templates/tests/smoke.yaml), less --api-url and --image (the simulated executor runs no
# pod); a long simulated run, so that what ends the job is the smoke's cancellation.
HELM_TEST_FLAGS = ["--team", "team-a", "--queue", "team-a", "--priority", "normal"]
LONG_RUN = f"--label={DURATION_LABEL}=100000"


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]],
                   ) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("smoke"), QUEUES, CLUSTER,
                            ("admission", "scheduler", "executor", "api")) as running:
        yield running


async def smoke(platform: ApiPlatform, *args: str, token: str | None = None) -> Result:
    """`gpuq smoke` as the helm test pod runs it: with DATABASE_URL to mint its token, or with a given GPUQ_TOKEN."""
    env = {"GPUQ_TOKEN": token or "", "DATABASE_URL": "" if token else platform.database_url, "COLUMNS": "200",
           "GPUQ_API_URL": ""}
    return await asyncio.to_thread(CliRunner().invoke, app, ["smoke", "--api-url", platform.base, "--poll", "0.2",
                                                             *HELM_TEST_FLAGS, *args], env=env)


def submitted(res: Result) -> str:
    found = re.search(r"smoke: submitted (\S+)", res.output)
    assert found, res.output
    return found.group(1)


async def smoke_tokens(platform: ApiPlatform) -> list[dict[str, object]]:
    rows = await platform.conn.fetch("SELECT id, name, team, role, expires_at, revoked_at FROM api.tokens "
                                     "WHERE name LIKE 'smoke-%' ORDER BY created_at")
    return [dict(r) for r in rows]


async def state(platform: ApiPlatform, job_id: str) -> str:
    rows = await fetch_status(platform.database_url, job_id)
    assert rows, job_id
    return str(rows[0]["state"])


async def test_smoke_places_a_job_through_the_api_then_cancels_it_and_revokes_its_token(platform: ApiPlatform) -> None:
    res = await smoke(platform, "--wait-for", "placed", "--gpu-model", "H100-80GB", "--timeout", "60", LONG_RUN)
    assert res.exit_code == 0, res.output
    job_id = submitted(res)
    assert job_id.startswith("team-a::")  # the API named it, for the token's team
    assert re.search(rf"smoke: {re.escape(job_id)} (placed|running) after", res.output), res.output
    assert f"smoke: {job_id} cancelled" in res.output and "smoke: passed" in res.output
    assert await state(platform, job_id) == "cancelled"
    (token,) = await smoke_tokens(platform)
    assert token["team"] == "team-a" and token["role"] != "admin"  # a team's token, never an admin's
    assert token["revoked_at"] is not None and token["expires_at"] is not None  # revoked, and it would expire anyway
    assert f"token {token['id']} revoked" in res.output


async def test_smoke_on_a_cluster_without_gpus_waits_for_admission_only(platform: ApiPlatform) -> None:
    res = await smoke(platform, "--wait-for", "admitted", "--gpu-model", "B200", "--timeout", "60")
    assert res.exit_code == 0, res.output
    job_id = submitted(res)
    assert f"smoke: {job_id} admitted after" in res.output
    assert await state(platform, job_id) == "cancelled"
    assert all(t["revoked_at"] is not None for t in await smoke_tokens(platform))


async def test_a_job_that_is_not_placed_in_time_fails_the_smoke_and_is_cleaned_up(platform: ApiPlatform) -> None:
    res = await smoke(platform, "--wait-for", "placed", "--gpu-model", "B200", "--timeout", "3")
    assert res.exit_code == 1, res.output
    job_id = submitted(res)
    assert "smoke: FAILED" in res.output and "not placed in time (states seen: " in res.output
    assert "admitted" in res.output.split("states seen:")[1]  # it says what it saw, and gpuq explain's lines
    assert await state(platform, job_id) == "cancelled"
    (token,) = await smoke_tokens(platform)
    assert token["revoked_at"] is not None


async def test_a_refused_job_fails_the_smoke_with_admissions_reason(platform: ApiPlatform) -> None:
    res = await smoke(platform, "--wait-for", "admitted", "--priority", "no-such-class", "--timeout", "30")
    assert res.exit_code == 1, res.output
    assert "smoke: FAILED" in res.output and "rejected" in res.output
    assert all(t["revoked_at"] is not None for t in await smoke_tokens(platform))


async def test_with_a_given_token_the_smoke_needs_no_database_and_leaves_the_token_alone(
        platform: ApiPlatform) -> None:
    res = await smoke(platform, "--wait-for", "placed", "--gpu-model", "H100-80GB", "--timeout", "60", LONG_RUN,
                      token=platform.tokens["a"])
    assert res.exit_code == 0, res.output
    assert await state(platform, submitted(res)) == "cancelled"
    assert not await smoke_tokens(platform) and "revoked" not in res.output
    async with httpx.AsyncClient() as client:  # the admin's token for the team still works
        resp = await client.get(platform.base + "/v1/jobs", headers=bearer(platform.tokens["a"]))
    assert resp.status_code == 200


async def test_without_a_token_or_a_database_the_smoke_says_what_it_needs(platform: ApiPlatform) -> None:
    res = await asyncio.to_thread(CliRunner().invoke, app, ["smoke", "--api-url", platform.base],
                                  env={"GPUQ_TOKEN": "", "DATABASE_URL": "", "COLUMNS": "200"})
    assert res.exit_code == 2 and "GPUQ_TOKEN" in res.output and "DATABASE_URL" in res.output
