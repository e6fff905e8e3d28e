"""`gpuq budget`: GPU-hour budgets per team (queues.yaml `budgets`), with the use in the current period and the
forecast to its end, as metering last computed them (its read model, metering.v1_budgets). Through the API
(GPUQ_API_URL): the token's team's budget, every team's for an admin's token; else with DATABASE_URL, every team's."""

from __future__ import annotations

import asyncio
from typing import Any

import typer
from rich.text import Text

from cli.api_client import api
from cli.output import Column, OutputFormat, output_option, print_machine, render_table, stdout_console, when
from cli.runtime import database_url

console = stdout_console()

COLUMNS = (Column("team"), Column("period"), Column("budget GPU-h", justify="right"),
           Column("used GPU-h", justify="right"), Column("used", justify="right"),
           Column("forecast GPU-h", justify="right", drop=2), Column("state"), Column("at 100%", drop=3),
           Column("reported", drop=4, wide=True))
STYLE = {"ok": "green", "warning": "yellow", "exhausted": "bold red"}
AT_100 = {"preemptible_only": "preemptible only", "approval": "admin approval"}


def budget(team: str | None = typer.Option(None, "--team", help="One team's budget (through the API: always "
                                                                  "your team's)"),
           output: OutputFormat = output_option("--format")) -> None:
    """GPU-hour budgets: use in the current month or quarter, the forecast to its end, and what happens at 100%."""
    client = api()
    if client is not None:
        rows: list[dict[str, Any]] = client.call("GET", "/v1/budgets")
    else:
        rows = asyncio.run(_direct())
    rows = [r for r in rows if team is None or r["team"] == team]
    if output.machine:
        print_machine(rows, output)
        return
    if not rows:
        console.print("no GPU-hour budgets (queues.yaml `budgets`), or metering has not reported them yet")
        return
    render_table(COLUMNS, [_row(r) for r in rows], fmt=output, console=console,
                 title=f"GPU-hour budgets ({len(rows)} team(s))")


def _row(r: dict[str, Any]) -> list[str | Text]:
    ratio = r["used_gpu_hours"] / r["budget_gpu_hours"]
    return [r["team"], r["period"], f"{r['budget_gpu_hours']:,.0f}", f"{r['used_gpu_hours']:,.1f}",
            f"{ratio:.0%}", f"{r['forecast_gpu_hours']:,.0f}", Text(r["state"], style=STYLE.get(r["state"], "")),
            AT_100.get(r["on_exhausted"], r["on_exhausted"]), when(r["reported_at"])]


async def _direct() -> list[dict[str, Any]]:
    import asyncpg

    from services.metering import budgetmodel

    conn = await asyncpg.connect(database_url())
    try:
        found = await budgetmodel.budgets(conn)
    finally:
        await conn.close()
    return [{**r.__dict__, "used_ratio": r.used_ratio, "period_start": r.period_start.isoformat(),
             "period_end": r.period_end.isoformat(), "reported_at": r.reported_at.isoformat()} for r in found]
