"""Where the CLI finds NATS and Postgres: the environment, else the servers `gpuq up` started and recorded
in its state directory (`.gpuq/servers.json`), else a clear error saying what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from shared.natsauth import write_private

STATE_DIR = Path(os.environ.get("GPUQ_HOME", ".gpuq"))
SERVERS_FILE = STATE_DIR / "servers.json"


def record_servers(nats_url: str, database_url: str) -> bool:
    """Record this process's servers, unless another `gpuq up` that still runs recorded its own (a standby must not
    take the file of the active instance). The URLs hold credentials (the database password, the admin's bus
    password): readable by the owner only. Returns whether this process owns the file now."""
    if active_instance() is not None:
        return False
    write_private(SERVERS_FILE, json.dumps({"nats_url": nats_url, "database_url": database_url, "pid": os.getpid()}))
    return True


def forget_servers() -> None:
    """Remove the servers file if this process recorded it; another instance's file is left alone."""
    if _recorded().get("pid") == os.getpid():
        SERVERS_FILE.unlink(missing_ok=True)


def active_instance() -> dict[str, Any] | None:
    """The servers file of another `gpuq up` whose process still runs, else None (a file left by a killed one is
    stale and may be replaced)."""
    recorded = _recorded()
    pid = recorded.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return recorded  # alive, another user's
    return recorded


def _recorded() -> dict[str, Any]:
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
