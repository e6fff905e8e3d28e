"""Platform admins' commands: API tokens, the bus users' configuration, the audit trail, and retention."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import typer

from cli.api_client import api
from cli.output import Column, OutputFormat, output_option, print_machine, render_table, stdout_console, when
from cli.runtime import database_url
from shared import namespace as namespaces  # light: nats-auth's --namespace names its environment variable

# The services' modules (the API's, the database's, the bus users') are imported in the commands that use them:
# `gpuq tokens --help` and the other commands start without them.

console = stdout_console()
tokens_app = typer.Typer(help="API bearer tokens (admins, with DATABASE_URL): create, list, revoke.",
                         no_args_is_help=True)


async def with_api_db(fn: Any) -> Any:
    """`fn(conn)` on the API's schema (migrated first), with DATABASE_URL: what the token commands do."""
    from services.api.app import MIGRATIONS as API_MIGRATIONS
    from shared.db import apply_migrations, create_pool

    pool = await create_pool(database_url(), min_size=1, max_size=2)
    try:
        await apply_migrations(pool, "api", API_MIGRATIONS)
        async with pool.acquire() as conn:
            return await fn(conn)
    finally:
        await pool.close()


@tokens_app.command("create")
def create_token(name: str = typer.Argument(..., help="Who holds it (audited as token:NAME / admin:NAME)"),
                 team: str | None = typer.Option(None, "--team", help="The team the token acts for"),
                 admin: bool = typer.Option(False, "--admin", help="A platform admin's token (sees everything)"),
                 days: int | None = typer.Option(None, "--days", help="Expire after this many days")) -> None:
    """Issue a token; it is printed once (only its hash is stored)."""
    from services.api import tokens as api_tokens

    expires = datetime.fromtimestamp(datetime.now(UTC).timestamp() + days * 86_400, UTC) if days else None
    try:
        issued = asyncio.run(with_api_db(lambda c: api_tokens.issue(c, name, team=team, admin=admin,
                                                                     expires_at=expires)))
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    console.print(f"token [bold]{issued.id}[/] for {'admin ' + name if admin else f'{name} of team {team}'}:")
    typer.echo(issued.token)


TOKEN_COLUMNS = (Column("id"), Column("name"), Column("team", drop=2), Column("role"), Column("created", drop=4),
                 Column("expires", drop=3), Column("revoked", drop=5))


@tokens_app.command("list")
def list_tokens(output: OutputFormat = output_option()) -> None:
    """Tokens (never their secrets)."""
    from services.api import tokens as api_tokens

    rows: list[dict[str, Any]] = asyncio.run(with_api_db(api_tokens.list_tokens))
    if output.machine:
        print_machine(rows, output)
        return
    render_table(TOKEN_COLUMNS, [[str(r["id"]), str(r["name"]), str(r["team"] or "-"), str(r["role"]),
                                  when(r["created_at"]), when(r["expires_at"]), when(r["revoked_at"])]
                                 for r in rows], fmt=output, console=console, title=f"{len(rows)} token(s)")


@tokens_app.command("revoke")
def revoke_token(token_id: str = typer.Argument(..., help="The token's id (or the token itself)")) -> None:
    """Revoke a token at once."""
    from services.api import tokens as api_tokens

    if not asyncio.run(with_api_db(lambda c: api_tokens.revoke(c, token_id))):
        console.print(f"[red]no active token {token_id}[/]")
        raise typer.Exit(1)
    console.print(f"revoked {token_id}")


def nats_auth(
    out: Path = typer.Option(Path("nats-auth"), "--out", help="Directory for nats-auth.conf and credentials.json"),
    queues: Path = typer.Option(..., "--queues", help="queues.yaml: each team in it gets a producer credential"),
    base_url: str | None = typer.Option(None, "--url", help="The server's nats:// URL as the platform's processes "
                                                            "reach it, to write each user's URL"),
    namespace: str | None = typer.Option(None, "--namespace", envvar=namespaces.ENV,
                                         help="The platform's namespace, which every permission names (the "
                                              "services' GPUQ_NAMESPACE; the chart's platformNamespace; "
                                              "default gpuq)"),
    kube_team: list[str] = typer.Option([], "--kube-team", help="Teams the Kubernetes intake may submit for "
                                                                   "(repeat; default: every team)"),
    admission_cohorts: list[str] = typer.Option(
        [], "--admission-cohorts", help="The cohorts of one admission instance that serves some cohorts only "
                                        "(GPUQ_ADMISSION_COHORTS, comma-separated; repeat per instance): admission "
                                        "may use that instance's consumers too"),
    rotate: list[str] = typer.Option([], "--rotate", help="With an existing credentials.json: new passwords for "
                                                         "these users only (repeat), the others kept"),
    kube_secrets_file: Path | None = typer.Option(
        None, "--kube-secrets", help="Also write Kubernetes Secrets (YAML, 0600) to this file: one per service user "
                                     "with its NATS_URL, as the Helm chart's natsAuth reads them, and one with "
                                     "nats-auth.conf for the server (needs --url)"),
    secret_prefix: str = typer.Option("gpuq-nats-", help="Name prefix of those Secrets (the chart's "
                                                          "natsAuth.secretPrefix)"),
    kube_namespace: str | None = typer.Option(None, help="Kubernetes namespace written into those Secrets "
                                                         "(default: none, kubectl's -n decides)"),
    bcrypt_cost: int = typer.Option(11, help="bcrypt cost of the password hashes in the server configuration"),
) -> None:
    """Write the bus users' configuration: `nats-auth.conf` (users, bcrypt hashes and subject permissions: include it
    in the nats-server configuration, then reload the server) and `credentials.json` (each user's password; give
    each service and team only its own). Both 0600. docs/security.md explains who may publish what; docs/install.md
    how to load them into a cluster."""
    from services.admission.sharding import Shard, parse_cohorts
    from shared.config import ConfigError, load_queues
    from shared.natsauth import NatsAuthError, generate, kube_secrets, read_credentials, write_bundle, write_private

    try:
        if kube_secrets_file is not None and not base_url:
            raise NatsAuthError("--kube-secrets needs --url: each Secret holds its user's whole NATS_URL")
        ns = namespaces.validate(namespace) if namespace else namespaces.current()
        config = load_queues(queues)
        teams = sorted({t for q in config.queues for t in q.teams} | set(config.governance.teams))
        kept: dict[str, str] = {}
        cred_file = out / "credentials.json"
        if rotate and not cred_file.exists():
            raise NatsAuthError(f"--rotate needs the existing {cred_file}: without it every password would change")
        if cred_file.exists():
            kept = {u: p for u, p in read_credentials(cred_file).items() if u not in rotate}
        suffixes = [Shard.of(cohorts).consumer_suffix for cohorts in admission_cohorts if parse_cohorts(cohorts)]
        bundle = generate(ns, teams, kube_teams=kube_team or None, bcrypt_cost=bcrypt_cost, passwords=kept,
                          admission_suffixes=suffixes)
        paths = write_bundle(bundle, out, base_url)
        if kube_secrets_file is not None:
            assert base_url is not None
            write_private(kube_secrets_file, kube_secrets(bundle, base_url, prefix=secret_prefix,
                                                          namespace=kube_namespace))
            paths.append(kube_secrets_file)
    except (ConfigError, NatsAuthError, namespaces.NamespaceError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    console.print(f"{len(bundle.users)} bus users for namespace {bundle.namespace} "
                  f"(teams: {', '.join(teams) or 'none'}): " + ", ".join(str(p) for p in paths)
                  + (f"; new passwords for {', '.join(sorted(rotate))}" if rotate else ""))


def audit(since: str | None = typer.Option(None, "--since", help="From (ISO date/time, 'today', or 7d, 12h ago)"),
          until: str | None = typer.Option(None, "--until", help="Until (same forms)"),
          team: str | None = typer.Option(None, "--team", help="One team's records (through the API: always yours)"),
          job: str | None = typer.Option(None, "--job", help="One job's records"),
          action: str | None = typer.Option(None, "--action", help="One action (submit, cancel, place, ...)"),
          limit: int = typer.Option(1000, help="At most this many records"),
          output: OutputFormat = output_option("--format")) -> None:
    """Who did what: submits, cancels, admissions, placements, preemptions, approvals, configuration and webhook
    changes, each with the actor's authenticated identity (the append-only audit trail)."""
    import asyncpg

    from services.metering.report import ReportError, parse_when

    now = datetime.now(UTC)
    try:
        lo = parse_when(since, now) if since else None
        hi = parse_when(until, now) if until else None
    except ReportError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    client = api()
    if client is not None:
        params = {k: v for k, v in {"since": lo.isoformat() if lo else None, "until": hi.isoformat() if hi else None,
                                    "team": team, "job_id": job, "action": action, "limit": limit}.items() if v}
        rows: list[dict[str, Any]] = client.call("GET", "/v1/audit", params=params)
    else:
        from services.audit.records import read_records

        async def load() -> list[dict[str, Any]]:
            conn = await asyncpg.connect(database_url())
            try:
                found = await read_records(conn, since=lo, until=hi, team=team, job_id=job, action=action,
                                           limit=limit)
            finally:
                await conn.close()
            return [{**r, "at": r["at"].isoformat()} for r in found]

        rows = asyncio.run(load())
    if output.machine:
        print_machine(rows, output)
        return

    def detail(r: dict[str, Any]) -> str:  # key=value pairs: free text that wraps between pairs
        return " ".join(f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}"
                        for k, v in (r.get("detail") or {}).items() if k != "event_id")

    render_table(AUDIT_COLUMNS, [[when(r["at"]), r["recorder"], r["action"], r["actor"], r.get("team") or "-",
                                  r.get("job_id") or "-", detail(r)] for r in rows],
                 fmt=output, console=console, title=f"{len(rows)} audit record(s)")


AUDIT_COLUMNS = (Column("at"), Column("recorder", drop=5), Column("action"), Column("actor", drop=3),
                 Column("team", drop=4), Column("job", drop=2), Column("detail", kind="text", drop=1))


def retention(
    metering_raw_days: int | None = typer.Option(
        None, "--metering-raw-days", help="Delete raw GPU samples older than this many days (0: keep; default: "
                                          "GPUQ_METERING_RAW_RETENTION_DAYS, else 30; at least 3)"),
    audit_days: int | None = typer.Option(
        None, "--audit-days", help="Drop the audit trail's months past this many days (0: keep; default: "
                                   "GPUQ_AUDIT_RETENTION_DAYS, else 400; at least 30)"),
) -> None:
    """Prune now what the metering and audit services prune every hour: raw GPU samples past their window (the hourly
    usage the reports read stays) and the audit trail's months past theirs (dropped whole; no record is ever changed
    or deleted). Also makes this month's and the next month's audit partitions. Needs DATABASE_URL."""
    import asyncpg

    from services.audit import retention as audit_retention
    from services.metering import store as metering
    from shared.retention import AUDIT, METERING_RAW

    env = dict(os.environ)
    for window, days in ((METERING_RAW, metering_raw_days), (AUDIT, audit_days)):
        if days is not None:
            env[window.env] = str(days)
    try:
        raw_days, trail_days = METERING_RAW.days(env), AUDIT.days(env)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    now = datetime.now(UTC)

    async def run() -> tuple[int | None, audit_retention.AuditRetention]:
        conn = await asyncpg.connect(database_url())
        try:
            samples = (await metering.prune_samples(conn, now - timedelta(days=raw_days))
                       if raw_days is not None else None)
            return samples, await audit_retention.run_once(conn, now, trail_days)
        finally:
            await conn.close()

    try:
        samples, trail = asyncio.run(run())
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedFunctionError) as exc:
        console.print(f"[red]this database lacks the metering or audit schema of this release ({exc}): start the "
                      "metering and audit services of this release on it first (they apply their migrations)[/]")
        raise typer.Exit(2) from None
    except asyncpg.RaiseError as exc:  # the database's own floor under the audit window
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    console.print("raw GPU samples: " + ("kept (no window)" if samples is None
                                         else f"{samples} deleted, older than {raw_days} days"))
    console.print("audit partitions: " + (f"made {', '.join(trail.created)}; " if trail.created else "")
                  + ("kept (no window)" if trail_days is None else
                     f"dropped {', '.join(trail.dropped) or 'none'} (past {trail_days} days)"))
