"""`gpuq webhooks add|list|rotate|enable|remove` against a real Postgres."""

from __future__ import annotations

import asyncio
import json
import time

import asyncpg
from typer.testing import CliRunner

from cli.main import app
from services.telemetry.webhooks import store


def gpuq(db: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["webhooks", *args], env={"DATABASE_URL": db, **(env or {})})
    return result.exit_code, result.output


def test_add_list_remove(pool: asyncpg.Pool, telemetry_db_url: str) -> None:
    # Synchronous on purpose: the commands run their own event loop (`pool` only resets the schema).
    code, out = gpuq(telemetry_db_url, "add", "https://93.184.216.34/hooks", "--team", "team-a",
                     "--events", "job.completed,job.preempted", "--json")
    assert code == 0, out
    sub = json.loads(out)
    assert sub["secret"].startswith("whsec_") and sub["events"] == ["job.completed", "job.preempted"]

    code, out = gpuq(telemetry_db_url, "list", "--json")
    assert code == 0, out
    assert [(s["id"], s["team"]) for s in json.loads(out)] == [(sub["id"], "team-a")]
    assert "whsec_" not in out

    code, out = gpuq(telemetry_db_url, "add", "http://127.0.0.1:9/x", "--team", "team-a")
    assert code == 1 and "loopback" in out
    code, out = gpuq(telemetry_db_url, "add", "http://127.0.0.1:9/x", "--team", "team-a",
                     env={"GPUQ_WEBHOOK_ALLOW_CIDRS": "127.0.0.0/8"})
    assert code == 0, out
    code, out = gpuq(telemetry_db_url, "add", "https://93.184.216.34/", "--events", "job.exploded")
    assert code == 1 and "unknown event" in out

    code, out = gpuq(telemetry_db_url, "remove", sub["id"])
    assert code == 0, out
    code, out = gpuq(telemetry_db_url, "remove", sub["id"])
    assert code == 1
    code, out = gpuq(telemetry_db_url, "list", "--json")
    assert [s["url"] for s in json.loads(out)] == ["http://127.0.0.1:9/x"]


def test_rotate_and_enable(pool: asyncpg.Pool, telemetry_db_url: str) -> None:
    code, out = gpuq(telemetry_db_url, "add", "https://93.184.216.34/hooks", "--json")
    assert code == 0, out
    sub = json.loads(out)
    code, out = gpuq(telemetry_db_url, "rotate", sub["id"], "--grace-hours", "2", "--json")
    assert code == 0, out
    rotated = json.loads(out)
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != sub["secret"]
    assert rotated["previous_secret_valid_until"] != "-"
    code, out = gpuq(telemetry_db_url, "rotate", "wh_nope")
    assert code == 1 and "no subscription" in out
    code, out = gpuq(telemetry_db_url, "rotate", sub["id"], "--grace-hours", "-1")
    assert code == 2

    asyncio.run(_disable(telemetry_db_url, sub["id"]))
    code, out = gpuq(telemetry_db_url, "list", "--json")
    (listed,) = json.loads(out)
    assert listed["active"] is False and "410" in listed["disabled_reason"]
    code, out = gpuq(telemetry_db_url, "enable", sub["id"])
    assert code == 0, out
    code, out = gpuq(telemetry_db_url, "list", "--json")
    assert json.loads(out)[0]["active"] is True
    assert "whsec_" not in out


async def _disable(url: str, sub_id: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await store.disable_subscription(conn, sub_id, time.time(), "HTTP 410 Gone from the test")
    finally:
        await conn.close()
