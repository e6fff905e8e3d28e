"""The other table commands through cli/output.py, on a real Postgres: `gpuq webhooks list`, `gpuq tokens list`,
`gpuq audit` and `gpuq report`. At an 80-column pseudo-terminal the identifiers a reader copies (the webhook id
`rotate` takes, token ids, queue names, costs) come out whole; piped or `-o wide`, every column; `-o json|yaml|csv`
say the same records."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
from datetime import UTC, datetime

import yaml
from typer.testing import CliRunner

from cli.main import app
from services.metering.testing import deliver, scenario
from shared.db import create_pool
from tests.service.cli.test_cli_terminal import _env, in_terminal

LONG_URL = "https://93.184.216.34/hooks/gpuq/foundation-models/job-state-changes?source=gpuq-production-cluster"


def run(args: list[str], env: dict[str, str]) -> str:
    """`gpuq ARGS` in this process, its stdout not a terminal (as piped); the pseudo-terminal runs are separate
    processes (in_terminal)."""
    done = CliRunner().invoke(app, args, env=env)
    assert done.exit_code == 0, done.output
    return done.stdout


def test_webhooks_and_tokens_keep_their_ids_whole(fresh_sync: tuple[str, str]) -> None:
    nats_url, database_url = fresh_sync
    env = _env(nats_url, database_url)
    added = json.loads(run(["webhooks", "add", LONG_URL, "--team", "foundation-models", "--events", "*", "--json"],
                           env))
    listed = json.loads(run(["webhooks", "list", "--json"], env))
    assert yaml.safe_load(run(["webhooks", "list", "-o", "yaml"], env)) == listed  # --json and -o say the same
    assert json.loads(run(["webhooks", "list", "-o", "json"], env)) == listed
    code, screen = in_terminal(["webhooks", "list"], env)
    assert code == 0 and max(len(line) for line in screen.splitlines()) <= 80, screen
    assert "…" not in screen and re.search(rf"^{added['id']}\s", screen, re.M), screen  # what `rotate` takes
    wide = run(["webhooks", "list", "-o", "wide"], env)
    assert any(added["id"] in line and LONG_URL in line for line in wide.splitlines()), wide

    token_ids = []
    for name in ("continuous-integration-pipeline", "foundation-models-training-bot"):
        out = run(["tokens", "create", name, "--team", "foundation-models", "--days", "30"], env)
        token_ids.append(re.search(r"token (\S+) for", out).group(1))  # type: ignore[union-attr]
    records = list(csv.DictReader(io.StringIO(run(["tokens", "list", "-o", "csv"], env))))
    assert [r["id"] for r in records] == token_ids and records[0]["name"] == "continuous-integration-pipeline"
    assert records[0]["revoked_at"] == ""
    code, screen = in_terminal(["tokens", "list"], env)
    assert code == 0 and max(len(line) for line in screen.splitlines()) <= 80, screen
    for token_id in token_ids:
        assert re.search(rf"^{re.escape(token_id)}\s", screen, re.M), screen
    assert "…" not in screen, screen
    assert "UTC" in run(["tokens", "list", "-o", "wide"], env)  # created and expiry, zoned


def test_report_fits_80_columns_and_o_names_a_format_or_the_export_file(
        fresh_sync: tuple[str, str], tmp_path: object) -> None:
    nats_url, database_url = fresh_sync

    async def fill() -> None:
        from services.metering.app import MIGRATIONS
        from shared.db import apply_migrations

        pool = await create_pool(database_url, min_size=1, max_size=2)
        try:
            await apply_migrations(pool, "metering", MIGRATIONS)
            await deliver(pool, scenario())
        finally:
            await pool.close()

    asyncio.run(fill())
    env = _env(nats_url, database_url)
    doc = json.loads(run(["report", "--by", "team,feature", "-o", "json"], env))
    assert json.loads(run(["report", "--by", "team,feature", "--format", "json"], env)) == doc  # the old spelling
    assert yaml.safe_load(run(["report", "--by", "team,feature", "-o", "yaml"], env)) == doc
    rows = list(csv.DictReader(io.StringIO(run(["report", "--by", "team,feature", "-o", "csv"], env))))
    assert [(r["team"], r["feature"], float(r["cost"])) for r in rows] == [
        (d["team"], d["feature"], d["cost"]) for d in doc["rows"]]

    code, screen = in_terminal(["report", "--by", "team,feature,project", "-g", "day"], env)
    assert code == 0 and max(len(line) for line in screen.splitlines()) <= 80, screen
    assert "…" not in screen, screen
    total = f"{doc['total']['cost']:,.2f}"
    assert re.search(rf"^total\s.*\s{re.escape(total)}\s*$", screen, re.M), screen  # the cost, whole
    wide = run(["report", "--by", "team,feature,project", "-g", "day", "-o", "wide"], env)
    assert all(h in wide for h in ("idle cost", "energy kWh", "lost GPU-h")), wide

    bad = CliRunner().invoke(app, ["report", "-o", "report.txt"], env=env)
    assert bad.exit_code == 2 and "not a format" in bad.output, bad.output
    out = f"{tmp_path}/focus.csv"
    run(["report", "--export", "focus", "-o", out], env)
    with open(out, newline="") as fh:
        assert list(csv.DictReader(fh))


def test_audit_keeps_job_ids_and_times_whole_and_its_detail_uncut(fresh_sync: tuple[str, str]) -> None:
    nats_url, database_url = fresh_sync
    job_id = "foundation-models-7b-run-0001"
    detail = {"reason": "a reason longer than the eighty characters the table used to cut every detail at, " * 2}

    async def record() -> None:
        from services.audit.app import _INSERT, MIGRATIONS
        from shared.db import apply_migrations

        pool = await create_pool(database_url, min_size=1, max_size=2)
        try:
            await apply_migrations(pool, "audit", MIGRATIONS)
            at = datetime.now(UTC)
            await pool.execute("SELECT audit.ensure_partition($1)", at)
            await pool.execute(_INSERT, "ev-1", "admission", at, "cancel", "token:continuous-integration",
                               "foundation-models", job_id, json.dumps(detail))
        finally:
            await pool.close()

    asyncio.run(record())
    env = _env(nats_url, database_url)
    records = json.loads(run(["audit", "--format", "json"], env))
    assert [(r["job_id"], r["detail"]) for r in records] == [(job_id, detail)]
    assert yaml.safe_load(run(["audit", "-o", "yaml"], env)) == records
    code, screen = in_terminal(["audit"], env)
    assert code == 0 and max(len(line) for line in screen.splitlines()) <= 80, screen
    assert "…" not in screen and re.search(rf"UTC\s+cancel\s+{job_id}\s", screen), screen
    # the detail wrapped between words, all of it there
    assert "reason=" + " ".join(detail["reason"].split()) in " ".join(screen.split()), screen
    wide = run(["audit", "-o", "wide"], env)
    assert detail["reason"].strip() in wide and "token:continuous-integration" in wide, wide  # whole, one line
