"""cli/output.py: machine output round-trips the records; tables never cut an identifier, fit a terminal by leaving
out droppable columns and wrapping free text, and print at full width when not at a terminal; times are zoned and an
ETA is never shown in the past."""

from __future__ import annotations

import csv
import io
import json

import pytest
import yaml
from rich.console import Console

from cli.output import (
    Column,
    OutputFormat,
    duration,
    eta_cell,
    eta_range_cell,
    machine_text,
    render_table,
    when,
)

RECORDS = [
    {"job_id": "team-a-0001", "queue": "research-long-queue-name", "gpus": 8, "eta": 1796501625.5,
     "nodes": ["h100-1", "h100-2"], "reason": None},
    {"job_id": "team-b-0002", "queue": "q", "gpus": 1, "eta": None, "nodes": [], "reason": "QuotaExceeded"},
]

COLUMNS = (Column("job"), Column("team", drop=3), Column("queue"), Column("submitted", drop=4),
           Column("nodes", kind="words", drop=2), Column("reason", kind="text", drop=1))
JOB = "research-pretraining-0042-abcdef"
QUEUE = "research-long-queue-name"
ROWS = [[JOB, "research", QUEUE, "2026-12-05 14:03:07 UTC", "h100-rack1-node-001, h100-rack1-node-002",
         "QuotaExceeded: waiting for the quota of H100-80GB in cohort research, 24 of 24 GPUs in use"],
        ["b-1", "t", "q", "2026-12-05 14:03:07 UTC", "-", "-"]]


def test_json_and_yaml_round_trip_the_records() -> None:
    assert json.loads(machine_text(RECORDS, OutputFormat.JSON)) == RECORDS
    assert yaml.safe_load(machine_text(RECORDS, OutputFormat.YAML)) == RECORDS


def test_csv_round_trips_the_records_as_text() -> None:
    rows = list(csv.DictReader(io.StringIO(machine_text(RECORDS, OutputFormat.CSV))))
    assert list(rows[0]) == ["job_id", "queue", "gpus", "eta", "nodes", "reason"]
    assert rows[0] == {"job_id": "team-a-0001", "queue": "research-long-queue-name", "gpus": "8",
                       "eta": "1796501625.5", "nodes": '["h100-1", "h100-2"]', "reason": ""}
    assert json.loads(rows[0]["nodes"]) == RECORDS[0]["nodes"]
    assert rows[1]["reason"] == "QuotaExceeded" and rows[1]["eta"] == ""


def _render(width: int, fmt: OutputFormat = OutputFormat.TABLE, terminal: bool = True,
            columns: tuple[Column, ...] = COLUMNS, rows: list[list[str]] = ROWS) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)
    render_table(columns, rows, fmt=fmt, console=console, title="jobs")
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_at_a_narrow_terminal_ids_stay_whole_and_columns_go() -> None:
    out = _render(80)
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in out
    assert any(JOB in line and QUEUE in line for line in lines)  # each on one line, whole
    assert "submitted" not in out and "team" not in out  # dropped, the highest `drop` first
    assert "reason" in out  # free text stays, wrapped
    assert "cohort research" in " ".join(line.strip() for line in lines)


def test_wide_shows_every_column_and_piped_prints_full_width() -> None:
    for out in (_render(80, OutputFormat.WIDE), _render(80, terminal=False)):
        assert "…" not in out
        header = out.splitlines()[1]
        assert header.split() == ["job", "team", "queue", "submitted", "nodes", "reason"]
        row = next(line for line in out.splitlines() if line.startswith(JOB))
        assert ROWS[0][-1] in row and ROWS[0][4] in row  # free text on one line: nothing wrapped
        assert len(row.rstrip()) > 80


def test_words_wrap_between_entries_never_inside_one() -> None:
    columns = (Column("queue"), Column("nominal", kind="words"))
    rows = [["q", " ".join(f"H100-80GB-model-{i}:{i * 8}" for i in range(8))]]
    out = _render(40, columns=columns, rows=rows)
    assert max(len(line) for line in out.splitlines()) <= 40
    cells = " ".join(line[len("queue  "):].strip() for line in out.splitlines()[2:])
    assert cells.split() == rows[0][1].split()
    for i in range(8):
        assert f"H100-80GB-model-{i}:{i * 8}" in out  # each entry whole on its line


def test_a_terminal_narrower_than_the_ids_folds_them_without_an_ellipsis() -> None:
    out = _render(20, columns=(Column("job"), Column("queue")), rows=[[JOB, QUEUE]])
    assert max(len(line) for line in out.splitlines()) <= 20
    assert "…" not in out
    joined = "".join(line.split()[0] for line in out.splitlines()[2:] if line.split())
    assert JOB in joined


def test_times_are_zoned_and_an_eta_is_never_in_the_past() -> None:
    assert when(1796501625) == "2026-12-05 20:13:45 UTC"
    assert when("2026-12-05T14:53:45+01:00") == "2026-12-05 13:53:45 UTC"
    assert when(None) == "-"
    now = 1796501625.0
    assert eta_cell(now - 60, now) == "any moment (overdue)"
    assert eta_cell(now + 60, now) == "2026-12-05 20:14:45 UTC"
    assert eta_range_cell(now + 60, now + 60, now) == "2026-12-05 20:14:45 UTC"  # a degenerate range: one time
    assert eta_range_cell(now - 600, now + 3600, now) == "2026-12-05 20:13:45 UTC to 21:13:45 UTC"
    assert eta_range_cell(now - 600, now - 60, now) == "any moment (overdue)"


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (4.6, "5s"), (754, "12m34s"), (11_100, "3h05m"),
                                               (187_200, "2d04h")])
def test_durations(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text


def test_the_apis_overdue_verdict_wins_over_this_machines_clock() -> None:
    now = 1796501625.0
    # a demo's platform clock runs ahead of this machine's: its ETA, in this machine's future, has passed there
    assert eta_cell(now + 600, now, overdue=True) == "any moment (overdue)"
    assert eta_cell(now - 600, now, overdue=False) == "2026-12-05 20:03:45 UTC"


def test_status_shows_the_apis_wait_and_never_a_past_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli import jobs

    now = 1796501625.0
    console = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    monkeypatch.setattr(jobs, "console", console)
    base = {"team": "t", "queue": "q", "gpus": 8, "submitted_at": now - 7200, "nodes": [], "reason": None,
            "message": None}
    rows = [
        # admitted, not placed: it still waits (the API's wait_s, on the platform's clock, wins)
        {**base, "job_id": "admitted-job", "state": "admitted", "admitted_at": now - 7000, "wait_s": 7260.0,
         "eta": now + 60, "eta_low": now + 60, "eta_high": now + 60, "eta_overdue": False},
        # admitted, not placed, read from the database (no wait_s): counted here, up to now
        {**base, "job_id": "admitted-direct", "state": "admitted", "admitted_at": now - 7000, "eta": None},
        # an ETA that has passed, as an older API (no eta_overdue) or the database gives it
        {**base, "job_id": "stale-eta-job", "state": "pending", "eta": now - 3600, "eta_low": now - 4000,
         "eta_high": now - 3000},
    ]
    jobs.print_status_table(rows, OutputFormat.WIDE, now)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    admitted = next(line for line in out.splitlines() if line.startswith("admitted-job"))
    assert "2h01m" in admitted  # 7260 s: the API's figure, still counting after admission
    assert admitted.count("2026-12-05 20:14:45 UTC") == 2  # the expected start; its range of one time is one time
    direct = next(line for line in out.splitlines() if line.startswith("admitted-direct"))
    assert "2h00m" in direct and "3m20s" not in direct  # not frozen at admission
    stale = next(line for line in out.splitlines() if line.startswith("stale-eta-job"))
    assert "2h00m" in stale and "any moment (overdue)" in stale
    assert "19:13" not in stale and "2026-12-05 19" not in stale  # no time in the past
