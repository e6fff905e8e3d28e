"""`gpuq report` end to end against the ledger in Postgres (a sync test: the command runs its own loop)."""

from __future__ import annotations

import csv
import json

import pytest
import pytest_asyncio
from typer.testing import CliRunner

from cli.main import app
from services.core.metering.focus import FOCUS_COLUMNS
from services.metering.testing import deliver, scenario
from tests.service.metering.focus_conformance import KNOWN_VALIDATOR_BUGS, own_checks, run_focus_validator

runner = CliRunner()


@pytest_asyncio.fixture(loop_scope="session")
async def filled(pool, metering_db_url):
    await deliver(pool, scenario())
    return metering_db_url


def test_report_by_team_json(filled):
    result = runner.invoke(app, ["report", "--by", "team", "--format", "json"], env={"DATABASE_URL": filled})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = {r["team"]: r for r in doc["rows"]}
    assert rows["team-a"]["allocated_gpu_hours"] == 16.0 and rows["team-a"]["cost"] == 64.0
    assert rows["team-a"]["utilization"] == 0.5 and rows["team-a"]["energy_kwh"] == 6.4
    assert rows["team-b"]["lost_gpu_hours"] == 0.25
    assert doc["total"]["allocated_gpu_hours"] == 24.0 and doc["rates"]["H100-80GB"] == 4.0
    assert doc["since"] == "2025-01-06T09:00:00+00:00" and doc["until"] == "2025-01-06T11:00:00+00:00"


def test_report_by_feature_csv_with_a_window(filled):
    result = runner.invoke(app, ["report", "--by", "feature", "--since", "2025-01-06T10:00Z", "--until",
                                 "2025-01-06T11:00Z", "--format", "csv"], env={"DATABASE_URL": filled})
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(result.stdout.splitlines()))
    # 10:00-11:00: only b-train's resumed run (8 GPUs, 10:00 to 10:10) is allocated.
    assert [(r["feature"], r["allocated_gpu_hours"]) for r in rows] == [("ads", "1.3333")]


def test_report_table_by_gpu_model_and_day(filled):
    result = runner.invoke(app, ["report", "--by", "gpu_model,priority_class", "-g", "day"],
                           env={"DATABASE_URL": filled, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "H100-80GB" in result.stdout and "total" in result.stdout and "2025-01-06" in result.stdout


def test_focus_export(filled, tmp_path):
    out = tmp_path / "focus.csv"
    result = runner.invoke(app, ["report", "--export", "focus", "--output", str(out)],
                           env={"DATABASE_URL": filled})
    assert result.exit_code == 0, result.output
    with out.open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == FOCUS_COLUMNS
        rows = list(reader)
    assert sorted(r["ResourceId"] for r in rows) == ["a-train", "b-train"]
    assert sum(float(r["BilledCost"]) for r in rows) == pytest.approx(96.0)
    assert json.loads(next(r for r in rows if r["ResourceId"] == "a-train")["Tags"])["project"] == "p1"


@pytest.mark.parametrize("args, message", [
    (["--since", "yesterday-ish"], "cannot read the time"),
    (["--export", "focus"], "needs --output"),
    (["--since", "2025-01-07", "--until", "2025-01-06"], "later than"),
])
def test_report_errors_are_precise(filled, args, message):
    result = runner.invoke(app, ["report", *args], env={"DATABASE_URL": filled})
    assert result.exit_code == 2
    assert message in result.output


def test_report_without_a_database_says_so():
    result = runner.invoke(app, ["report"], env={"DATABASE_URL": ""})
    assert result.exit_code == 2 and "DATABASE_URL" in result.output


def test_focus_export_conforms_to_focus_1_0(filled, tmp_path):
    """The official validator passes the export except on its known bugs, where our own checks pass instead."""
    out = tmp_path / "focus.csv"
    result = runner.invoke(app, ["report", "--export", "focus", "--output", str(out), "-g", "hour"],
                           env={"DATABASE_URL": filled})
    assert result.exit_code == 0, result.output
    with out.open() as fh:
        assert len(list(csv.DictReader(fh))) >= 3
    report = run_focus_validator(out, tmp_path / "focus-validator.xml")
    assert report.checks >= 100, "the validator ran its FOCUS 1.0 rule set"
    real = {check: message for check, message in report.failed.items() if check not in KNOWN_VALIDATOR_BUGS}
    assert real == {}, f"focus-validator: {real}"
    assert own_checks(out) == []


def test_focus_checks_catch_a_nonconforming_export(filled, tmp_path):
    """The harness is not vacuous: drop RegionId and blank ProviderName and SkuPriceId, and both checks say so."""
    good = tmp_path / "focus.csv"
    assert runner.invoke(app, ["report", "--export", "focus", "--output", str(good)],
                         env={"DATABASE_URL": filled}).exit_code == 0
    with good.open(newline="") as fh:
        reader = csv.DictReader(fh)
        columns = [c for c in reader.fieldnames or () if c != "RegionId"]
        rows = [{**{c: r[c] for c in columns}, "ProviderName": "", "SkuPriceId": ""} for r in reader]
    bad = tmp_path / "bad.csv"
    with bad.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    report = run_focus_validator(bad, tmp_path / "bad.xml")
    assert "RegionId_Required" in report.failed
    problems = own_checks(bad)
    assert "column RegionId is missing" in problems
    assert any("ProviderName is null" in p for p in problems)
    assert any("SkuPriceId is null on a Usage charge" in p for p in problems)
