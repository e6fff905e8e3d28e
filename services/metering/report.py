"""`gpuq report`: usage and cost rollups from the metering ledger, and the FinOps FOCUS export."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import re
import time
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from cli.output import FORMAT_HELP, Column, OutputFormat, print_machine, render_table, stdout_console, when
from services.core.metering.focus import FOCUS_COLUMNS, focus_rows
from services.core.metering.rollup import (
    ALL_DIMENSIONS,
    Granularity,
    RollupRow,
    Totals,
    aligned_window,
    build_cells,
    grand_total,
    rollup,
)
from services.core.metering.units import HOUR_MS, from_ms, mj_to_kwh, to_ms

_RELATIVE = re.compile(r"^-?(\d+)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


class Export(StrEnum):
    FOCUS = "focus"


class ReportError(Exception):
    """A problem the user can fix (bad option, no database); printed without a traceback."""


def parse_when(text: str, now: datetime) -> datetime:
    """`now`, `today`, a duration ago (`7d`, `-12h`, `30m`, `2w`), or an ISO date/datetime (naive = UTC)."""
    t = text.strip().lower()
    if t == "now":
        return now
    if t == "today":
        return now.replace(hour=0, minute=0, second=0, microsecond=0)
    m = _RELATIVE.match(t)
    if m:
        return now - timedelta(seconds=int(m.group(1)) * _UNIT_S[m.group(2)])
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"cannot read the time {text!r}: use an ISO date or datetime (2025-01-31, "
                          "2025-01-31T12:00Z), 'now', 'today', or a duration ago such as 7d, 12h, 30m") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def parse_by(text: str) -> tuple[str, ...]:
    """Dimensions to group by: job, team, queue, priority_class, kind, user, gpu_model, or a job label
    (`feature`, `project`, or `label:KEY` for any other key), comma-separated."""
    dims = tuple(d.strip() for d in text.split(",") if d.strip())
    if not dims:
        raise ReportError("--by needs at least one dimension")
    for d in dims:
        if not re.match(r"^(label:)?[A-Za-z0-9_.\-/]+$", d):
            raise ReportError(f"--by {d!r} is not a dimension; use one of {', '.join(ALL_DIMENSIONS)}, "
                              "a label name such as feature or project, or label:KEY")
    return dims


def _figures(t: Totals) -> dict[str, Any]:
    util = t.used_gpu_ms / t.allocated_gpu_ms if t.allocated_gpu_ms else 0.0
    return {
        "jobs": len(t.jobs),
        "allocated_gpu_hours": round(t.allocated_gpu_ms / HOUR_MS, 4),
        "used_gpu_hours": round(t.used_gpu_ms / HOUR_MS, 4),
        "idle_gpu_hours": round(t.idle_gpu_ms / HOUR_MS, 4),
        "utilization": round(util, 4),
        "lost_gpu_hours": round(t.lost_gpu_ms / HOUR_MS, 4),
        "energy_kwh": round(mj_to_kwh(t.energy_mj), 4),
        "cost": round(t.cost, 2),
        "idle_cost": round(t.idle_cost, 2),
    }


def row_dicts(rows: list[RollupRow], by: tuple[str, ...], granularity: Granularity) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        d: dict[str, Any] = dict(zip(by, r.key, strict=True))
        if granularity is not Granularity.TOTAL:
            d["period_start"] = from_ms(r.period_start_ms).isoformat()
        d.update(_figures(r.totals))
        out.append(d)
    return out


def resolve_output(fmt: OutputFormat | None, export: Export | None,
                   output: str | None) -> tuple[OutputFormat, Path | None]:
    """The format and the --export file from `--format` and `-o/--output`: `-o` names a format (table, wide, json,
    yaml, csv) as for every table command, or with --export the file to write."""
    if export is not None:
        return fmt or OutputFormat.TABLE, Path(output) if output else None
    if output is None:
        return fmt or OutputFormat.TABLE, None
    try:
        return OutputFormat(output.lower()), None
    except ValueError:
        raise ReportError(f"-o {output}: not a format (table, wide, json, yaml or csv); a file is written only with "
                          "--export focus") from None


REPORT_FIGURES = (Column("jobs", justify="right", drop=1), Column("allocated GPU-h", justify="right"),
                  Column("used GPU-h", justify="right", drop=3), Column("idle GPU-h", justify="right", drop=5),
                  Column("util", justify="right", drop=2), Column("lost GPU-h", justify="right", drop=6),
                  Column("energy kWh", justify="right", drop=4), Column("cost", justify="right"),
                  Column("idle cost", justify="right", drop=7))


def render(doc: dict[str, Any], *, fmt: OutputFormat, console: Console) -> None:
    """Print a report document (`report_document`'s shape, also what the API answers) as a table (cli/output.py: at
    a terminal the less important figures are left out to fit; `wide` or piped, all), CSV, JSON or YAML."""
    by: list[str] = list(doc["by"])
    hourly_or_daily = doc["granularity"] != Granularity.TOTAL.value
    dicts: list[dict[str, Any]] = doc["rows"]
    total: dict[str, Any] = doc["total"]
    if fmt in (OutputFormat.JSON, OutputFormat.YAML):
        print_machine(doc, fmt)
        return
    if fmt is OutputFormat.CSV:
        print_machine(dicts, fmt, fields=[*by, *(["period_start"] if hourly_or_daily else []), *total])
        return

    def cells(f: dict[str, Any]) -> list[str]:
        return [str(f["jobs"]), f"{f['allocated_gpu_hours']:,.2f}", f"{f['used_gpu_hours']:,.2f}",
                f"{f['idle_gpu_hours']:,.2f}", f"{f['utilization']:.0%}", f"{f['lost_gpu_hours']:,.2f}",
                f"{f['energy_kwh']:,.2f}", f"{f['cost']:,.2f}", f"{f['idle_cost']:,.2f}"]

    columns = [*(Column(d) for d in by), *([Column("period")] if hourly_or_daily else []), *REPORT_FIGURES]

    def period(start: str) -> str:  # a day is its date; an hour its zoned time
        return start[:10] if doc["granularity"] == Granularity.DAY.value else when(start)

    rows = [[*(str(row[k]) for k in by), *([period(row["period_start"])] if hourly_or_daily else []), *cells(row)]
            for row in dicts]
    pad = [""] * (len(by) - 1 + hourly_or_daily)
    render_table(columns, rows, fmt=fmt, console=console, totals=[["total", *pad, *cells(total)]],
                 title=f"GPU usage and cost by {', '.join(by)}, {when(doc['since'])} to {when(doc['until'])}")


def document(rows: list[RollupRow], *, by: tuple[str, ...], granularity: Granularity, since_ms: int, until_ms: int,
             rates: dict[str, float]) -> dict[str, Any]:
    """The report as one JSON-able document (what `--format json` prints and the API answers)."""
    lo, hi = aligned_window(since_ms, until_ms)
    return {"since": from_ms(lo).isoformat(), "until": from_ms(hi).isoformat(), "by": list(by),
            "granularity": granularity.value, "rates": rates, "rows": row_dicts(rows, by, granularity),
            "total": _figures(grand_total(rows))}


async def _load(database_url: str, since: str | None, until: str | None, queues: Path | None,
                now: datetime, team: str | None = None) -> tuple[Any, dict[str, float], int, int]:
    import asyncpg  # the shell only: keeps `gpuq --help` fast

    from services.metering import store

    try:
        conn = await asyncpg.connect(database_url)
    except (OSError, asyncpg.PostgresError) as exc:
        raise ReportError(f"cannot connect to Postgres: {exc}") from None
    try:
        lo = parse_when(since, now) if since else None
        hi = parse_when(until, now) if until else None
        try:
            ledger = await store.load_ledger(conn, lo, hi)
            rates = await store.load_rates(conn)
            if team is not None:  # one team's jobs only (the API scopes each caller to its team)
                mine = {j for j, d in ledger.dims.items() if d.team == team}
                ledger = dataclasses.replace(
                    ledger, allocations=[a for a in ledger.allocations if a.job_id in mine],
                    usage=[u for u in ledger.usage if u.job_id in mine])
        except asyncpg.UndefinedTableError:
            raise ReportError("this database holds no metering ledger (schema `metering` is missing): "
                              "point DATABASE_URL at the database the gpuq services use") from None
    finally:
        await conn.close()
    if queues is not None:
        from shared.config import ConfigError, load_queues

        try:
            config = load_queues(queues)
        except ConfigError as exc:
            raise ReportError(str(exc)) from None
        rates = {m: f.cost_per_gpu_hour for m, f in config.gpu_flavors.items()}
    # Without bounds the report covers what the ledger holds: its first record up to its horizon
    # (accelerated or replayed time may be far from the wall clock).
    horizon = ledger.horizon_ms if ledger.horizon_ms is not None else to_ms(now)
    starts = [a.placed_at_ms for a in ledger.allocations] + [u.hour_ms for u in ledger.usage]
    since_ms = to_ms(lo) if lo else (min(starts) if starts else horizon)
    until_ms = to_ms(hi) if hi else max(horizon, since_ms + 1)
    cells = build_cells(ledger.allocations, ledger.usage, since_ms=since_ms, until_ms=until_ms,
                        horizon_ms=min(horizon, until_ms))
    return (cells, ledger.dims), rates, since_ms, until_ms


async def report_document(database_url: str, *, by: str = "team", since: str | None = None,
                          until: str | None = None, granularity: Granularity = Granularity.TOTAL,
                          team: str | None = None, now: datetime) -> dict[str, Any]:
    """The report as `gpuq report --format json` prints it, optionally for one team's jobs only."""
    dims_by = parse_by(by)
    (cells, dims), rates, since_ms, until_ms = await _load(database_url, since, until, None, now, team)
    if until_ms <= since_ms:
        raise ReportError("until must be later than since")
    rows = rollup(cells, dims, by=dims_by, granularity=granularity, since_ms=since_ms, until_ms=until_ms,
                  rates=rates)
    return document(rows, by=dims_by, granularity=granularity, since_ms=since_ms, until_ms=until_ms, rates=rates)


async def team_gpu_hours(database_url: str, *, now: datetime) -> dict[str, float]:
    """Allocated GPU-hours per team over everything the ledger holds: the figure `gpuq report --by team` totals,
    and the one the demo's report shows per team. Both read the metering ledger (every allocation of every run,
    open ones up to the ledger's horizon); the demo's table summed the executor's runs instead, the latest run of
    each job only and from its start, and disagreed with the report (issue 51: 357 against 400 GPU-hours)."""
    doc = await report_document(database_url, by="team", now=now)
    return {str(r["team"]): float(r["allocated_gpu_hours"]) for r in doc["rows"]}


async def focus_document(database_url: str, *, since: str | None = None, until: str | None = None,
                         granularity: Granularity = Granularity.DAY, team: str | None = None,
                         now: datetime) -> list[dict[str, Any]]:
    """FinOps FOCUS rows (one per job, GPU model and day or hour), optionally for one team's jobs only."""
    (cells, dims), rates, since_ms, until_ms = await _load(database_url, since, until, None, now, team)
    if until_ms <= since_ms:
        raise ReportError("until must be later than since")
    gran = Granularity.DAY if granularity is Granularity.TOTAL else granularity
    return focus_rows(cells, dims, since_ms=since_ms, until_ms=until_ms, granularity=gran, rates=rates)


def write_focus(rows: list[dict[str, Any]], output: Path, err: Console) -> None:
    with output.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(FOCUS_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    total = sum(float(r["BilledCost"]) for r in rows)
    err.print(f"wrote {len(rows)} FOCUS rows ({total:,.2f} billed) to {output}")


def report(
    by: str = typer.Option("team", "--by", help="Group by: team, queue, feature, project, gpu_model, "
                           "priority_class, job, kind, user, or label:KEY; comma-separate several."),
    since: str | None = typer.Option(None, "--since", help="Start: ISO date/time (UTC if no zone), 'today', "
                                     "or a duration ago (7d, 12h). Default: the ledger's first record."),
    until: str | None = typer.Option(None, "--until", help="End (same forms). Default: the ledger's latest "
                                     "record. The window is widened to whole hours."),
    granularity: Granularity = typer.Option(Granularity.TOTAL, "--granularity", "-g",
                                            help="One row per group (total), or per hour or day."),
    fmt: OutputFormat | None = typer.Option(None, "--format", "-f", help=f"{FORMAT_HELP} (as -o).",
                                            case_sensitive=False),
    export: Export | None = typer.Option(None, "--export", help="Write a FinOps FOCUS CSV to --output "
                                         "(one row per job, GPU model and day; --granularity hour for hourly)."),
    output: str | None = typer.Option(None, "--output", "-o", help=f"{FORMAT_HELP}; with --export, the FILE "
                                      "to write."),
    queues: Path | None = typer.Option(None, "--queues", help="Price GPUs with this queues.yaml's gpu_flavors "
                                       "cost_per_gpu_hour instead of the prices stored by the service."),
    database_url: str | None = typer.Option(None, "--database-url", envvar="DATABASE_URL",
                                            help="Postgres holding the metering ledger (env DATABASE_URL)."),
) -> None:
    """GPU usage and cost: allocated, used, idle and lost GPU-hours, energy and cost, grouped by team,
    queue, label, GPU model or priority class, from the metering ledger in Postgres. With GPUQ_API_URL and
    GPUQ_TOKEN set: through the API, your team's jobs only."""
    console = stdout_console()
    err = Console(stderr=True)
    try:
        if not database_url:
            raise ReportError("gpuq report reads the metering ledger in Postgres: set DATABASE_URL (or pass "
                              "--database-url) to the database the gpuq services write to")
        dims_by = parse_by(by)
        fmt, file = resolve_output(fmt, export, output)
        if export is not None and file is None:
            raise ReportError("--export focus needs --output FILE.csv")
        now = datetime.fromtimestamp(time.time(), tz=UTC)
        (cells, dims), rates, since_ms, until_ms = asyncio.run(_load(database_url, since, until, queues, now))
        if until_ms <= since_ms:
            raise ReportError("--until must be later than --since")
    except ReportError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    if export is Export.FOCUS:
        assert file is not None
        gran = Granularity.DAY if granularity is Granularity.TOTAL else granularity
        write_focus(focus_rows(cells, dims, since_ms=since_ms, until_ms=until_ms, granularity=gran, rates=rates),
                    file, err)
        return
    rows = rollup(cells, dims, by=dims_by, granularity=granularity, since_ms=since_ms, until_ms=until_ms,
                  rates=rates)
    render(document(rows, by=dims_by, granularity=granularity, since_ms=since_ms, until_ms=until_ms, rates=rates),
           fmt=fmt, console=console)
