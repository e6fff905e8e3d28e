"""Where the CLI finds NATS and Postgres: the environment, else the servers `gpuq up` started and recorded
in its state directory (`.gpuq/servers.json`), else a clear error saying what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from shared.natsauth import write_private

STATE_DIR = Path(os.environ.get("GPUQ_HOME", ".gpuq"))
SERVERS_FILE = STATE_DIR / "servers.json"


def record_servers(nats_url: str, database_url: str) -> None:
    """The URLs hold credentials (the database password, the admin's bus password): readable by the owner only."""
    write_private(SERVERS_FILE, json.dumps({"nats_url": nats_url, "database_url": database_url, "pid": os.getpid()}))


def forget_servers() -> None:
    SERVERS_FILE.unlink(missing_ok=True)


def _recorded() -> dict[str, str]:
    if SERVERS_FILE.exists():
        try:
            return dict(json.loads(SERVERS_FILE.read_text()))
        except ValueError:
            return {}
    return {}


def database_url() -> str:
    url = os.environ.get("DATABASE_URL") or _recorded().get("database_url")
    if not url:
        raise typer.BadParameter("no database: set DATABASE_URL, or start the platform with `gpuq up` first",
                                 param_hint="DATABASE_URL")
    return url


def nats_url() -> str:
    url = os.environ.get("NATS_URL") or _recorded().get("nats_url")
    if not url:
        raise typer.BadParameter("no NATS server: set NATS_URL, or start the platform with `gpuq up` first",
                                 param_hint="NATS_URL")
    return url
