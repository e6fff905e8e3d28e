"""`gpuq dead-letters`: the messages the services could not handle, with their reasons (a malformed CloudEvent from
a pipeline, an event no longer valid, an outbox row the bus refused). Through the API (GPUQ_API_URL, GPUQ_TOKEN) a
team's token lists the dead letters of messages published on its own subjects; admin mode (DATABASE_URL) lists
every service's."""

from __future__ import annotations

import asyncio
from typing import Any

import typer

from cli.api_client import api
from cli.output import Column, OutputFormat, output_option, print_machine, render_table, stdout_console, when
from cli.runtime import database_url

DEAD_LETTER_COLUMNS = (Column("at"), Column("service", drop=3), Column("reason"), Column("subject", drop=2),
                       Column("seq", drop=4, justify="right"), Column("deliveries", drop=5, justify="right"),
                       Column("bytes", drop=6, justify="right"), Column("message", kind="text", drop=1))


def dead_letters(limit: int = typer.Option(50, min=1, max=1000, help="At most this many, newest first"),
                 reason: str | None = typer.Option(None, "--reason", help="Only this reason (e.g. InvalidEvent)"),
                 output: OutputFormat = output_option("--format")) -> None:
    """Recent dead letters with their reasons: messages a service could not handle, kept with why."""
    client = api()
    if client is not None:
        params: dict[str, Any] = {"limit": limit, **({"reason": reason} if reason else {})}
        rows: list[dict[str, Any]] = client.call("GET", "/v1/dead-letters", params=params)
    else:
        import asyncpg

        from shared import deadletters

        async def load() -> list[dict[str, Any]]:
            conn = await asyncpg.connect(database_url())
            try:
                found = await deadletters.recent(conn, team=None, limit=limit, reason=reason)
            finally:
                await conn.close()
            return [{**vars(d), "at": d.at.isoformat()} for d in found]

        rows = asyncio.run(load())
    if output.machine:
        print_machine(rows, output)
        return
    if not rows:
        typer.echo("no dead letters")
        return
    # the reason's message is what the reader came for: free text, wrapped, never cut
    render_table(DEAD_LETTER_COLUMNS, [[when(r["at"]), str(r["service"]), str(r["reason"]), str(r["subject"]),
                                        str(r["stream_seq"]), str(r["deliveries"]), str(r["body_bytes"]),
                                        str(r["message"])] for r in rows],
                 fmt=output, console=stdout_console(), title=f"{len(rows)} dead letter(s), newest first")
