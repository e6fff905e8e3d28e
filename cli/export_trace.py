"""`gpuq export-trace`: the platform's own finished jobs as a simulator trace (sim/export.py), to replay against a
changed queues.yaml with `gpuq simulate` (a what-if on the platform's own history). Needs DATABASE_URL."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import typer

from cli.runtime import database_url


def export_trace(
    since: str = typer.Option(..., "--since", help="First submission kept: ISO date/time (naive = UTC) or epoch s"),
    until: str = typer.Option(..., "--until", help="Submissions before this: ISO date/time or epoch seconds"),
    out: Path | None = typer.Option(None, "--out", "-o", help="The trace CSV (default: standard output)"),
    cluster_out: Path | None = typer.Option(None, "--cluster-out", help="Also write the platform's nodes now as a "
                                                                        "cluster.yaml (for --cluster)"),
    queues_out: Path | None = typer.Option(None, "--queues-out", help="Also write the queue configuration in force "
                                                                      "as a queues.yaml (the baseline)"),
) -> None:
    """Write the platform's own finished jobs as a simulator trace: the jobs submitted in [--since, --until) that
    ran, with their specs, limits (estimates), priority classes, queues, checkpointing and actual run times. Replay
    it with `gpuq simulate --trace <csv> --cluster <cluster.yaml> --queues <queues.yaml>`, the queues changed or
    not."""
    import asyncpg
    import yaml

    from services.admission import configmodel, runsmodel
    from services.scheduler import readmodel
    from sim.export import cluster_document, write_trace
    from sim.loaders import TraceError, parse_time

    try:
        start, end = parse_time(since), parse_time(until)
    except TraceError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since/--until") from None
    if start >= end:
        raise typer.BadParameter(f"--since ({since}) must be before --until ({until})", param_hint="--since")

    async def read() -> tuple[list[runsmodel.FinishedRun], dict[str, int], Any, Any]:
        conn = await asyncpg.connect(database_url())
        try:
            runs, left_out = await runsmodel.finished_runs(conn, start, end)
            nodes = await readmodel.nodes(conn) if cluster_out is not None else []
            config = await configmodel.in_force(conn) if queues_out is not None else None
            return runs, left_out, nodes, config
        finally:
            await conn.close()

    runs, left_out, nodes, config = asyncio.run(read())
    rows = ((r.spec, r.submitted_at, r.ran_s) for r in runs)
    if out is None:
        written, refused = write_trace(rows, sys.stdout)
    else:
        with out.open("w", newline="") as fh:
            written, refused = write_trace(rows, fh)
    if cluster_out is not None:
        if not nodes:
            typer.echo("no node is known to the scheduler: no cluster.yaml written", err=True)
        else:
            cluster_out.write_text(yaml.safe_dump(cluster_document(nodes), sort_keys=False))
    if queues_out is not None:
        if config is None:
            typer.echo("admission has recorded no queue configuration: no queues.yaml written", err=True)
        else:
            queues_out.write_text(yaml.safe_dump(config.config.model_dump(mode="json", exclude_defaults=True),
                                                 sort_keys=False))
    skipped = {**left_out, **refused}
    summary = f"{written} jobs written" + (f"; left out: {', '.join(f'{n} {why}' for why, n in skipped.items())}"
                                           if skipped else "")
    typer.echo(summary, err=True)  # (standard output may be the trace)
