"""Users' commands that live with their service (`gpuq report`: metering; `gpuq webhooks`: telemetry), through the
API when GPUQ_API_URL is set, as the other users' commands are: the caller then sees and changes only what its
token's team may (an admin's token: everything). Without GPUQ_API_URL they work on the database directly (admins).

`via_api(direct, remote)` keeps the direct command's options, defaults and help (typer reads the signature that
`functools.wraps` exposes), so each command is declared once, in its service's module."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from cli.api_client import ApiClient, api
from cli.output import OutputFormat, stdout_console
from services.metering.report import Export, ReportError, render, resolve_output, write_focus
from services.metering.report import report as direct_report

console = stdout_console()
err = Console(stderr=True)

Remote = Callable[..., None]


def via_api(direct: Callable[..., None], remote: Remote) -> Callable[..., None]:
    """A command with `direct`'s options that runs `remote(client, **options)` when GPUQ_API_URL is set."""

    @functools.wraps(direct)
    def command(**options: Any) -> None:
        client = api()
        if client is None:
            direct(**options)
        else:
            remote(client, **options)

    return command


def _refuse(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)


# ------------------------------------------------------------------------------------------------ gpuq report


def report_remote(client: ApiClient, *, by: str, since: str | None, until: str | None, granularity: Any, fmt: Any,
                  export: Export | None, output: str | None, queues: Any, database_url: str | None) -> None:
    """The token's team's usage and cost (an admin's token: every team's), computed by the API from the ledger."""
    if queues is not None:
        raise _refuse("--queues (pricing with another queues.yaml) reads the ledger directly: an admin's command, "
                      "not available through the API")
    try:
        fmt, file = resolve_output(fmt, export, output)
    except ReportError as exc:
        raise _refuse(str(exc)) from None
    params = {k: v for k, v in {"since": since, "until": until, "granularity": granularity.value}.items() if v}
    if export is Export.FOCUS:
        if file is None:
            raise _refuse("--export focus needs --output FILE.csv")
        write_focus(client.call("GET", "/v1/report/focus", params=params), file, err)
        return
    render(client.call("GET", "/v1/report", params={**params, "by": by}), fmt=fmt, console=console)


# ------------------------------------------------------------------------------------------------ gpuq webhooks


def webhooks_add_remote(client: ApiClient, *, url: str, team: str | None, events: str, as_json: bool,
                        database_url: str | None) -> None:
    names = [e.strip() for e in events.split(",") if e.strip()]
    sub = client.call("POST", "/v1/webhooks", json={"url": url, "events": names, "team": team})
    if as_json:
        typer.echo(json.dumps(sub))
        return
    console.print(f"subscription [bold]{sub['id']}[/bold] → {sub['url']} ({', '.join(sub['events'])}; "
                  f"team {sub['team'] or 'all'})")
    console.print(f"signing secret: [bold]{sub['secret']}[/bold]  (shown once)")


def webhooks_list_remote(client: ApiClient, *, team: str | None, as_json: bool, output: OutputFormat,
                         database_url: str | None) -> None:
    subs: list[dict[str, Any]] = client.call("GET", "/v1/webhooks")
    from services.telemetry.cli import print_subscriptions

    print_subscriptions([s for s in subs if team is None or s["team"] == team],
                        OutputFormat.JSON if as_json else output, console)


def webhooks_rotate_remote(client: ApiClient, *, sub_id: str, grace_hours: float, as_json: bool,
                           database_url: str | None) -> None:
    sub = client.call("POST", f"/v1/webhooks/{sub_id}/rotate", params={"grace_hours": grace_hours})
    if as_json:
        typer.echo(json.dumps(sub))
        return
    console.print(f"new signing secret for [bold]{sub['id']}[/bold]: [bold]{sub['secret']}[/bold]  (shown once)")
    console.print(f"the previous secret also signs until {sub['previous_secret_valid_until'] or '-'}")


def webhooks_enable_remote(client: ApiClient, *, sub_id: str, database_url: str | None) -> None:
    client.call("POST", f"/v1/webhooks/{sub_id}/enable")
    console.print(f"enabled {sub_id}")


def webhooks_remove_remote(client: ApiClient, *, sub_id: str, database_url: str | None) -> None:
    client.call("DELETE", f"/v1/webhooks/{sub_id}")
    console.print(f"removed {sub_id}")


def webhooks_reencrypt_remote(client: ApiClient, *, database_url: str | None) -> None:
    raise _refuse("re-encrypting the stored signing secrets needs the secrets key and the database: an admin runs it "
                  "without GPUQ_API_URL, where both are (e.g. kubectl exec deploy/gpuq-api -- gpuq webhooks "
                  "reencrypt)")


WEBHOOKS_REMOTE: dict[str, Remote] = {
    "add": webhooks_add_remote, "list": webhooks_list_remote, "rotate": webhooks_rotate_remote,
    "enable": webhooks_enable_remote, "remove": webhooks_remove_remote, "reencrypt": webhooks_reencrypt_remote,
}

report = via_api(direct_report, report_remote)


def _webhooks_app() -> typer.Typer:
    from services.telemetry.cli import webhooks_app as direct_webhooks

    app = typer.Typer(help=direct_webhooks.info.help, no_args_is_help=True)
    for info in direct_webhooks.registered_commands:
        assert info.name is not None and info.callback is not None
        app.command(info.name)(via_api(info.callback, WEBHOOKS_REMOTE[info.name]))
    return app


def __getattr__(name: str) -> Any:
    """`webhooks_app`, built when first asked for: the telemetry service's modules load with `gpuq webhooks`, not
    with `gpuq report` (cli/main.py loads each command on demand)."""
    if name == "webhooks_app":
        globals()[name] = app = _webhooks_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
