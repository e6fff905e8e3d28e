"""`gpuq preemptible --queue Q`: the running jobs that could be taken now, and why (or why not)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict

import typer

from cli.output import Column, OutputFormat, output_option, print_machine, render_table, stdout_console, when

# At a narrow terminal the job, GPUs and whether it is takeable stay, the reason wrapped; nothing is cut.
COLUMNS = (Column("job"), Column("queue", drop=3), Column("class", drop=4), Column("GPUs", justify="right"),
           Column("takeable"), Column("lost GPU-s", justify="right", drop=2),
           Column("could be taken by", kind="words", drop=5), Column("why", kind="text", drop=1),
           Column("protected until", wide=True))


def preemptible(
    queue: str = typer.Option(None, "--queue", "-q", help="Only jobs of this queue (default: every queue)."),
    database_url: str = typer.Option(None, "--database-url", envvar="DATABASE_URL",
                                     help="Postgres URL (default: $DATABASE_URL)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table (as -o json)."),
    output: OutputFormat = output_option(),
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
    output = OutputFormat.JSON if as_json else output
    if output.machine:
        print_machine([asdict(r) for r in rows], output)
        return
    render_table(COLUMNS, [[r.job_id, r.queue, r.priority_class, f"{r.gpus:g}", "yes" if r.takeable else "no",
                            f"{r.lost_gpu_seconds:.0f}", r.by or "-", r.why, when(r.protected_until)] for r in rows],
                 fmt=output, console=stdout_console(), title=f"preemptible now{f' in {queue}' if queue else ''}")
