"""`gpuq webhooks add|list|rotate|enable|remove`: manage webhook subscriptions (stored in Postgres, schema
telemetry)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import typer
from rich.console import Console

from cli.output import Column, OutputFormat, output_option, print_machine, render_table, stdout_console, when

# The webhook store, the SSRF guard and the database module (the event catalogue, cryptography, asyncpg) are imported
# by the commands that use them: `gpuq webhooks --help` and `gpuq webhooks list -h` start without them.

webhooks_app = typer.Typer(help="Webhook subscriptions: signed CloudEvents POSTed to your URL when your "
                                "jobs change state. With GPUQ_API_URL and GPUQ_TOKEN set: through the API, your "
                                "team's subscriptions only.", no_args_is_help=True)
console = stdout_console()

DbOption = typer.Option(None, "--database-url", envvar="DATABASE_URL",
                        help="Postgres URL of the gpuq database (env DATABASE_URL).")


SubIdArgument = typer.Argument(..., metavar="ID", help="Subscription id (from `gpuq webhooks list`).")


def _store() -> Any:
    from services.telemetry.webhooks import store

    return store


def _unknown(sub_id: str) -> typer.Exit:
    console.print(f"[red]no subscription {sub_id}[/red]")
    return typer.Exit(1)


def _url(database_url: str | None) -> str:
    if not database_url:
        console.print("[red]no database: pass --database-url or set DATABASE_URL[/red]")
        raise typer.Exit(2)
    return database_url


async def _with_conn(database_url: str, fn: Any) -> Any:
    # the service's module (its metrics exporter, the bus) only when a command touches the database: `gpuq webhooks
    # --help` starts without it
    from services.telemetry.app import MIGRATIONS
    from shared.db import apply_migrations, create_pool

    pool = await create_pool(database_url, min_size=1, max_size=2)
    try:
        await apply_migrations(pool, "telemetry", MIGRATIONS)
        async with pool.acquire() as conn:
            return await fn(conn)
    finally:
        await pool.close()


@webhooks_app.command("add")
def add(url: str = typer.Argument(..., help="Receiver URL (http or https, public address)."),
        team: str | None = typer.Option(None, "--team", help="Only this team's jobs (omit: every team)."),
        events: str = typer.Option("job.completed,job.failed,job.preempted", "--events",
                                   help="Comma-separated job events (job.completed, job.failed, job.preempted, "
                                        "...), or * for all; an unknown name is refused with the full list"),
        as_json: bool = typer.Option(False, "--json", help="Print the subscription as JSON."),
        database_url: str | None = DbOption) -> None:
    """Subscribe URL to events; prints the subscription id and its signing secret (shown once).

    Keep the secret to verify the `webhook-signature` header (Standard Webhooks)."""
    from services.telemetry.webhooks import store
    from services.telemetry.webhooks.ssrf import ALLOW_ENV, AllowList, TargetRefused, resolve_target

    try:
        names = store.validate_events(events.split(","))
        asyncio.run(resolve_target(url, AllowList.from_env()))
    except TargetRefused as exc:
        console.print(f"[red]refused: {exc}[/red] (allow-list env: {ALLOW_ENV})")
        raise typer.Exit(1) from None
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    sub = asyncio.run(_with_conn(_url(database_url), lambda c: store.add_subscription(c, url, team, names)))
    if as_json:
        typer.echo(json.dumps({"id": sub.id, "url": sub.url, "team": sub.team, "events": list(sub.events),
                               "secret": sub.secret}))
        return
    console.print(f"subscription [bold]{sub.id}[/bold] → {sub.url} ({', '.join(sub.events)}; "
                  f"team {sub.team or 'all'})")
    console.print(f"signing secret: [bold]{sub.secret}[/bold]  (shown once)")


# `gpuq webhooks list`'s columns: the id (what `rotate`, `enable` and `remove` take) is never cut; the URL is left out
# rather than cut at a narrow terminal (`-o wide` or piped shows it).
WEBHOOK_COLUMNS = (Column("id"), Column("url", drop=2), Column("team", drop=3), Column("events", kind="words", drop=4),
                   Column("created", drop=5), Column("state", kind="text"))


def print_subscriptions(subs: list[dict[str, Any]], output: OutputFormat, console: Console) -> None:
    """Subscriptions as `list` prints them, directly or through the API (GET /v1/webhooks' records)."""
    if output.machine:
        print_machine(subs, output)
        return
    rows = [[s["id"], s["url"], s.get("team") or "(all)", ", ".join(s["events"]), when(s.get("created_at")),
             "active" if s["active"] else f"disabled: {s.get('disabled_reason') or 'by an operator'}"] for s in subs]
    render_table(WEBHOOK_COLUMNS, rows, fmt=output, console=console, title=f"{len(subs)} webhook subscription(s)")


@webhooks_app.command("list")
def list_(team: str | None = typer.Option(None, "--team", help="Only this team's subscriptions."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON (as -o json)."),
          output: OutputFormat = output_option(),
          database_url: str | None = DbOption) -> None:
    """List subscriptions (secrets are not shown)."""
    subs = asyncio.run(_with_conn(_url(database_url), lambda c: _store().list_subscriptions(c, team)))
    print_subscriptions([{"id": s.id, "url": s.url, "team": s.team, "events": list(s.events), "active": s.active,
                          "disabled_reason": s.disabled_reason, "created_at": s.created_at.isoformat()}
                         for s in subs], OutputFormat.JSON if as_json else output, console)


@webhooks_app.command("rotate")
def rotate(sub_id: str = SubIdArgument,
           grace_hours: float = typer.Option(24.0, "--grace-hours", min=0,
                                             help="How long the old secret keeps signing too (two signatures per "
                                                  "delivery), so the receiver can switch without downtime."),
           as_json: bool = typer.Option(False, "--json", help="Print the new secret as JSON."),
           database_url: str | None = DbOption) -> None:
    """Give a subscription a new signing secret (shown once). Until the grace period ends every delivery carries
    a signature with the new secret and one with the old, so the receiver may switch at any moment in between."""
    sub = asyncio.run(_with_conn(_url(database_url),
                                 lambda c: _store().rotate_secret(c, sub_id, time.time(), grace_hours * 3600)))
    if sub is None:
        raise _unknown(sub_id)
    until = sub.previous_secret_expires_at.isoformat(timespec="seconds") if sub.previous_secret_expires_at else "-"
    if as_json:
        typer.echo(json.dumps({"id": sub.id, "secret": sub.secret, "previous_secret_valid_until": until}))
        return
    console.print(f"new signing secret for [bold]{sub.id}[/bold]: [bold]{sub.secret}[/bold]  (shown once)")
    console.print(f"the previous secret also signs until {until}")


@webhooks_app.command("enable")
def enable(sub_id: str = SubIdArgument,
           database_url: str | None = DbOption) -> None:
    """Re-enable a subscription its receiver disabled (410 Gone); its waiting deliveries are sent again."""
    enabled = asyncio.run(_with_conn(_url(database_url), lambda c: _store().enable_subscription(c, sub_id)))
    if not enabled:
        raise _unknown(sub_id)
    console.print(f"enabled {sub_id}")


@webhooks_app.command("remove")
def remove(sub_id: str = SubIdArgument,
           database_url: str | None = DbOption) -> None:
    """Remove a subscription and its pending deliveries."""
    removed = asyncio.run(_with_conn(_url(database_url), lambda c: _store().remove_subscription(c, sub_id)))
    if not removed:
        raise _unknown(sub_id)
    console.print(f"removed {sub_id}")


@webhooks_app.command("reencrypt")
def reencrypt(database_url: str | None = DbOption) -> None:
    """Encrypt every stored signing secret with the newest key of GPUQ_SECRETS_KEY (after a key rotation, keep the
    old key second in the list until this has run)."""

    async def go(conn: Any) -> int:
        async with conn.transaction():
            return await _store().reencrypt_secrets(conn)

    count = asyncio.run(_with_conn(_url(database_url), go))
    console.print(f"re-encrypted {count} signing secret(s)")
