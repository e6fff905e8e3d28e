"""`gpuq dead-letters`: the messages the services could not handle, with their reasons (a malformed CloudEvent from
a pipeline, an event no longer valid, an outbox row the bus refused). Through the API (GPUQ_API_URL, GPUQ_TOKEN) a
team's token lists the dead letters of messages published on its own subjects; admin mode (DATABASE_URL) lists
every service's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import typer

from cli.api_client import api
from cli.runtime import database_url


def dead_letters(limit: int = typer.Option(50, min=1, max=1000, help="At most this many, newest first"),
                 reason: str | None = typer.Option(None, "--reason", help="Only this reason (e.g. InvalidEvent)"),
                 output: str = typer.Option("text", "--format", help="text or json")) -> None:
    """Recent dead letters with their reasons: messages a service could not handle, kept with why."""
    if output not in ("text", "json"):
        raise typer.BadParameter(f"{output!r}: use text or json", param_hint="--format")
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
    if output == "json":
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        typer.echo("no dead letters")
        return
    typer.echo(f"{len(rows)} dead letter(s), newest first:")
    for r in rows:
        # one record per block, nothing cut: the reason's message is what the reader came for
        typer.echo(f"{str(r['at'])[:19]}  {r['service']}  {r['reason']}  {r['subject']}  (seq {r['stream_seq']}, "
                   f"{r['deliveries']} deliveries, {r['body_bytes']} bytes)")
        typer.echo(f"    {r['message']}")
