"""Where the CLI finds NATS and Postgres: the environment, else the servers `gpuq up` started and recorded
in its state directory, else a clear error saying what to do.

`gpuq up` records the servers' URLs without their credentials in `servers.json`, and the credentials (each URL's
user:password) in `credentials.json` beside it, readable by the owner only: a copied, shared or printed
`servers.json` gives nobody the admin's bus password or the database's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import typer

from shared.natsauth import write_private

STATE_DIR = Path(os.environ.get("GPUQ_HOME", ".gpuq"))
SERVERS_FILE = STATE_DIR / "servers.json"
CREDENTIALS_FILE = STATE_DIR / "credentials.json"
_URLS = ("nats_url", "database_url")


def split_userinfo(url: str) -> tuple[str, str]:
    """(`url` without its `user:password@`, that userinfo as written, percent-encoding kept; "" if none)."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, ""
    return urlunsplit(parts._replace(netloc=host)), userinfo


def join_userinfo(url: str, userinfo: str) -> str:
    if not userinfo:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}"))


def record_servers(nats_url: str, database_url: str) -> bool:
    """Record this process's servers, unless another `gpuq up` that still runs recorded its own (a standby must not
    take the file of the active instance). The credentials in the URLs (the database password, the admin's bus
    password) go to the credentials file only, first, so that a reader of the servers file finds them. Returns
    whether this process owns the files now."""
    if active_instance() is not None:
        return False
    plain = {key: split_userinfo(url) for key, url in zip(_URLS, (nats_url, database_url), strict=True)}
    pid = os.getpid()
    write_private(CREDENTIALS_FILE, json.dumps({"pid": pid, **{k: info for k, (_, info) in plain.items()}}))
    write_private(SERVERS_FILE, json.dumps({**{k: url for k, (url, _) in plain.items()}, "pid": pid}))
    return True


def forget_servers() -> None:
    """Remove the servers and credentials files if this process recorded them; another instance's are left alone."""
    if _recorded().get("pid") == os.getpid():
        SERVERS_FILE.unlink(missing_ok=True)
        CREDENTIALS_FILE.unlink(missing_ok=True)


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


def _read(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _recorded() -> dict[str, Any]:
    """The servers file, its URLs with the credentials of the credentials file written with it (same pid)."""
    recorded = _read(SERVERS_FILE)
    if not recorded:
        return {}
    secrets = _read(CREDENTIALS_FILE)
    if secrets.get("pid") == recorded.get("pid"):
        for key in _URLS:
            if isinstance(recorded.get(key), str) and isinstance(secrets.get(key), str):
                recorded[key] = join_userinfo(recorded[key], secrets[key])
    return recorded


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
