"""`gpuq report` and `gpuq webhooks` through the API (GPUQ_API_URL, GPUQ_TOKEN), like the other users' commands: a
team's token reports on and manages only its team's; an admin's token everything. The commands run in a thread
(they are synchronous HTTP clients) against the API served by a running platform."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from click.testing import Result
from typer.testing import CliRunner

from cli.main import app
from services.metering.testing import deliver, scenario
from services.telemetry.webhooks.ssrf import ALLOW_ENV
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform
from tests.service.security.test_attacks import CLUSTER, QUEUES


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]],
                   monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ApiPlatform]:
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.0/8")  # the test's webhook receiver address is local
    async with api_platform(auth_server, await make_database("cliapi"), QUEUES, CLUSTER,
                            ("metering", "telemetry", "audit", "api")) as running:
        # The ledger of metering's scenario: team-a's and team-b's jobs (services/metering/testing.py).
        assert running.stack.pool is not None
        await deliver(running.stack.pool, scenario())
        yield running


async def gpuq(platform: ApiPlatform, who: str, *args: str) -> Result:
    """`gpuq ARGS` as `who`'s token, through the API only (no database in its environment)."""
    env = {"GPUQ_API_URL": platform.base, "GPUQ_TOKEN": platform.tokens[who], "DATABASE_URL": "", "COLUMNS": "200"}
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def ok(res: Result) -> str:
    assert res.exit_code == 0, res.output
    return res.stdout


async def test_report_through_the_api_covers_only_the_tokens_team(platform: ApiPlatform, tmp_path: Path) -> None:
    mine = json.loads(ok(await gpuq(platform, "a", "report", "--by", "team", "--format", "json")))
    assert [r["team"] for r in mine["rows"]] == ["team-a"]
    assert mine["rows"][0]["allocated_gpu_hours"] == 16.0 and mine["rows"][0]["cost"] == 64.0
    everyone = json.loads(ok(await gpuq(platform, "admin", "report", "--by", "team", "--format", "json")))
    assert sorted(r["team"] for r in everyone["rows"]) == ["team-a", "team-b"]
    # A team's token cannot widen its view by naming another team: the API scopes it to its own.
    by_job = json.loads(ok(await gpuq(platform, "b", "report", "--by", "job", "--format", "json")))
    assert {r["job"] for r in by_job["rows"]} == {"b-train"}
    # The table and CSV renderings, from the API's document.
    assert "team-a" in ok(await gpuq(platform, "a", "report", "-g", "hour")) and "total" in \
        ok(await gpuq(platform, "a", "report"))
    rows = list(csv.DictReader(ok(await gpuq(platform, "a", "report", "--by", "feature", "--format",
                                             "csv")).splitlines()))
    assert [r["feature"] for r in rows] == ["search"]
    # FOCUS export: the team's own charges only.
    out = tmp_path / "focus.csv"
    res = await gpuq(platform, "a", "report", "--export", "focus", "--output", str(out))
    assert res.exit_code == 0, res.output
    with out.open() as fh:
        focus = list(csv.DictReader(fh))
    assert focus and {r["SubAccountId"] for r in focus} == {"team-a"}
    # What only an admin's direct access can do is refused with the reason, not attempted.
    res = await gpuq(platform, "a", "report", "--queues", "queues.yaml")
    assert res.exit_code == 2 and "not available through the API" in res.output
    res = await gpuq(platform, "a", "report", "--since", "yesterday-ish")
    assert res.exit_code == 1 and "cannot read the time" in res.output


async def test_webhooks_through_the_api_are_the_tokens_teams(platform: ApiPlatform) -> None:
    added: dict[str, Any] = json.loads(ok(await gpuq(platform, "a", "webhooks", "add", "http://127.0.0.1:9/hook",
                                                     "--json")))
    assert added["team"] == "team-a" and added["secret"]  # the token's team, whatever the command line says
    res = await gpuq(platform, "a", "webhooks", "add", "http://127.0.0.1:9/other", "--team", "team-b")
    assert res.exit_code == 1 and "manages team 'team-a'" in res.output
    sub = added["id"]
    listed = json.loads(ok(await gpuq(platform, "a", "webhooks", "list", "--json")))
    assert [s["id"] for s in listed] == [sub]
    assert json.loads(ok(await gpuq(platform, "b", "webhooks", "list", "--json"))) == []
    # Another team can neither rotate, re-enable nor remove it: to mallory it does not exist.
    for command in (("rotate", sub), ("enable", sub), ("remove", sub)):
        res = await gpuq(platform, "b", "webhooks", *command)
        assert res.exit_code == 1 and f"no subscription {sub}" in res.output, command
    rotated = json.loads(ok(await gpuq(platform, "a", "webhooks", "rotate", sub, "--grace-hours", "1", "--json")))
    assert rotated["id"] == sub and rotated["secret"] != added["secret"] and rotated["previous_secret_valid_until"]
    ok(await gpuq(platform, "a", "webhooks", "enable", sub))
    # Re-encryption needs the key and the database: an admin's direct command.
    res = await gpuq(platform, "admin", "webhooks", "reencrypt")
    assert res.exit_code == 2 and "without GPUQ_API_URL" in res.output
    ok(await gpuq(platform, "a", "webhooks", "remove", sub))
    assert json.loads(ok(await gpuq(platform, "admin", "webhooks", "list", "--json"))) == []
    # Every change is audited with the token's identity.
    actions = {(r["action"], r["actor"]) for r in await platform.conn.fetch(
        "SELECT action, actor FROM audit.records WHERE action LIKE 'webhook_%'")} if await _audited(platform) else set()
    assert {("webhook_add", "token:alice"), ("webhook_rotate", "token:alice"), ("webhook_enable", "token:alice"),
            ("webhook_remove", "token:alice")} <= actions


async def _audited(platform: ApiPlatform) -> bool:
    """The audit service stores records asynchronously (from the API's outbox): wait for the last one."""
    for _ in range(300):
        if await platform.conn.fetchval("SELECT count(*) FROM audit.records WHERE action = 'webhook_remove'"):
            return True
        await asyncio.sleep(0.1)
    return False
