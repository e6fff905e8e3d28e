"""Through the API, on the authenticated bus with the platform running (the simulated executor announces 16 H100):
the configuration check says what admission would refuse and PUT /v1/queues/config refuses it unless forced;
GET /v1/dead-letters (and `gpuq dead-letters`) shows a team only the dead letters of its own subjects, an admin all;
/metrics counts them per reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
import yaml
from click.testing import Result
from typer.testing import CliRunner

from cli.main import app
from shared.config import queues_document
from shared.health import exposition
from shared.namespace import subject as ns_subject
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform, bearer
from tests.service.security.test_attacks import CLUSTER, QUEUES


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer,
                   make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("safetyapi"), QUEUES, CLUSTER,
                            ("admission", "scheduler", "executor", "api", "audit")) as running:
        yield running


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def gpuq(platform: ApiPlatform, who: str, *args: str) -> Result:
    env = {"GPUQ_API_URL": platform.base, "GPUQ_TOKEN": platform.tokens[who], "DATABASE_URL": "", "COLUMNS": "300"}
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def oversized() -> dict[str, Any]:
    doc = queues_document(QUEUES)
    doc["queues"][0]["quotas"]["H100-80GB"]["nominal"] = 80
    return doc


async def test_the_check_and_a_refused_change_unless_forced(platform: ApiPlatform, tmp_path: Path) -> None:
    conn = platform.conn
    await until(lambda: _true(conn.fetchval("SELECT count(*) = 2 FROM scheduler.v1_nodes WHERE NOT removed")))
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as http:
        admin, team = bearer(platform.tokens["admin"]), bearer(platform.tokens["a"])
        r = await http.post("/v1/queues/config/check", json={"config": oversized()}, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json()["diff"] == ["~ queue team-a: H100-80GB 8 → 80"]
        assert r.json()["refusals"] == ["guaranteed H100-80GB sums to 88 but the cluster has 16: guarantees cannot "
                                        "all be honoured at once"]
        assert (await http.post("/v1/queues/config/check", json={"config": oversized()},
                                headers=team)).status_code == 403

        refused = await http.put("/v1/queues/config", json={"config": oversized()}, headers=admin)
        assert refused.status_code == 409 and "sums to 88 but the cluster has 16" in refused.text, refused.text
        forced = await http.put("/v1/queues/config", json={"config": oversized(), "force": True}, headers=admin)
        assert forced.status_code == 202, forced.text
    await until(lambda: _true(conn.fetchval("SELECT count(*) = 2 FROM admission.config")))
    detail = json.loads(await conn.fetchval("SELECT detail FROM admission.audit WHERE action = 'config_applied' "
                                            "ORDER BY id DESC LIMIT 1"))
    assert detail["forced"] is True and detail["overridden"], detail
    # the API's own record of the request says it was forced (the audit service's trail)
    await until(lambda: _true(conn.fetchval(
        "SELECT count(*) = 1 FROM audit.records WHERE action = 'config_change_request' "
        "AND (detail->>'force')::boolean")))

    # `gpuq apply-queues --dry-run` through the API: the check's verdict against version 2 (88 in force now, 96
    # raises it again), nothing applied.
    bigger = oversized()
    bigger["queues"][1]["quotas"]["H100-80GB"]["nominal"] = 16
    (tmp_path / "queues.yaml").write_text(yaml.safe_dump(bigger))
    dry = await gpuq(platform, "admin", "apply-queues", "--dry-run", str(tmp_path / "queues.yaml"))
    assert dry.exit_code == 1, dry.output
    assert "~ queue team-b: H100-80GB 8 → 16" in dry.stdout and "refused: guaranteed H100-80GB sums to 96" in dry.stdout
    assert "dry run: nothing applied" in dry.stdout
    refused_cli = await gpuq(platform, "admin", "apply-queues", "--wait", "0", str(tmp_path / "queues.yaml"))
    assert refused_cli.exit_code == 1 and "not applied" in refused_cli.stdout, refused_cli.output


async def test_dead_letters_are_scoped_to_the_teams_subjects_and_counted_per_reason(
        platform: ApiPlatform, auth_server: AuthServer) -> None:
    for team in ("team-a", "team-b"):
        nc, js, _ = await auth_server.connect(f"producer-{team}")
        try:
            await js.publish(ns_subject(f"job.submitted.{team}"), b'{"not": "a cloudevent"}')
        finally:
            await nc.close()
    conn = platform.conn
    await until(lambda: _true(conn.fetchval("SELECT count(*) = 2 FROM admission.dead_letters")))
    async with httpx.AsyncClient(base_url=platform.base, timeout=30) as http:
        async def seen(who: str) -> list[dict[str, Any]]:
            r = await http.get("/v1/dead-letters", headers=bearer(platform.tokens[who]))
            assert r.status_code == 200, r.text
            rows: list[dict[str, Any]] = r.json()
            return rows

        mine = await seen("a")
        assert [d["subject"] for d in mine] == [ns_subject("job.submitted.team-a")]
        assert mine[0]["service"] == "admission" and mine[0]["reason"] and mine[0]["message"]
        assert [d["subject"] for d in await seen("b")] == [ns_subject("job.submitted.team-b")]
        assert sorted(d["subject"] for d in await seen("admin")) == [ns_subject("job.submitted.team-a"),
                                                                    ns_subject("job.submitted.team-b")]
    listed = await gpuq(platform, "a", "dead-letters")
    assert listed.exit_code == 0, listed.output
    assert "job.submitted.team-a" in listed.stdout and "team-b" not in listed.stdout
    assert mine[0]["message"] in listed.stdout
    reason = mine[0]["reason"]
    metrics = exposition(await platform.stack.health())
    assert f'gpuq_dead_letters_total{{service="admission",reason="{reason}"}} 2' in metrics, metrics


async def _true(value: Awaitable[Any]) -> bool:
    return bool(await value)
