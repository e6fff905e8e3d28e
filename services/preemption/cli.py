"""`gpuq preemptible --queue Q`: the running jobs that could be taken now, and why (or why not)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict

import typer
from rich.console import Console
from rich.table import Table


def preemptible(
    queue: str = typer.Option(None, "--queue", "-q", help="Only jobs of this queue (default: every queue)."),
    database_url: str = typer.Option(None, "--database-url", envvar="DATABASE_URL",
                                     help="Postgres URL (default: $DATABASE_URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the running jobs that could be preempted now, the work each would lose, who could take it,
    and for the others the reason they are safe (production class, protection window, ...)."""
    from services.preemption.visibility import Exposure, preemptible_in_queue

    url = database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise typer.BadParameter("set --database-url or DATABASE_URL")

    async def fetch() -> list[Exposure]:
        import asyncpg

        conn = await asyncpg.connect(url)
        try:
            return await preemptible_in_queue(conn, queue, time.time())
        finally:
            await conn.close()

    rows = asyncio.run(fetch())
    if as_json:
        typer.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table(title=f"preemptible now{f' in {queue}' if queue else ''}")
    for col in ("job", "queue", "class", "GPUs", "takeable", "why", "lost GPU-s", "could be taken by"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.job_id, r.queue, r.priority_class, f"{r.gpus:g}", "yes" if r.takeable else "no", r.why,
                      f"{r.lost_gpu_seconds:.0f}", r.by)
    Console().print(table)
