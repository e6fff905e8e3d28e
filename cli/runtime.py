"""Where the CLI finds NATS, Postgres and the API: the environment, else the config file, else the servers a
running `gpuq up` recorded in its state directory, else a clear error saying what to do.

The config file is `$GPUQ_CONFIG`, else `$XDG_CONFIG_HOME/gpuq/config.yaml` (`~/.config/gpuq/config.yaml`), a YAML
mapping with any of `nats_url`, `database_url`, `api_url`, `token` and `state_dir`. `gpuq up` writes `state_dir` there
(the absolute path of its state directory), so that admin commands run from any directory find the platform it
started. The environment (NATS_URL, DATABASE_URL, GPUQ_API_URL, GPUQ_TOKEN, GPUQ_HOME) always wins over the file.

`gpuq up` records the servers' URLs without their credentials in `servers.json`, and the credentials (each URL's
user:password) in `credentials.json` beside it, readable by the owner only: a copied, shared or printed
`servers.json` gives nobody the admin's bus password or the database's.

Imported by every command: it stays light (the standard library and typer; yaml only when a config file exists)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import typer

STATE_DIR = Path(os.environ.get("GPUQ_HOME", ".gpuq"))
SERVERS_FILE = STATE_DIR / "servers.json"
CREDENTIALS_FILE = STATE_DIR / "credentials.json"
_URLS = ("nats_url", "database_url")
CONFIG_ENV = "GPUQ_CONFIG"
# config key -> the environment variable that overrides it
CONFIG_KEYS = {"nats_url": "NATS_URL", "database_url": "DATABASE_URL", "api_url": "GPUQ_API_URL",
               "token": "GPUQ_TOKEN", "state_dir": "GPUQ_HOME"}


class ConfigFileError(ValueError):
    """The config file cannot be read or holds something else than its keys."""


def config_path() -> Path:
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpuq" / "config.yaml"


def read_config(path: Path | None = None) -> dict[str, str]:
    """The config file's settings ({} when there is none); a malformed one is refused naming the file and what is
    wrong (a typo in a key would otherwise send commands elsewhere without a word)."""
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigFileError(f"config file {path}: {exc.strerror or exc}") from None
    if not text.strip():
        return {}
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"config file {path}: not YAML: {' '.join(str(exc).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigFileError(f"config file {path}: a mapping of {', '.join(CONFIG_KEYS)} is expected, "
                              f"not a {type(doc).__name__}")
    unknown = sorted(str(k) for k in doc if k not in CONFIG_KEYS)
    if unknown:
        raise ConfigFileError(f"config file {path}: unknown key(s) {', '.join(unknown)} (known: "
                              f"{', '.join(CONFIG_KEYS)})")
    bad = sorted(str(k) for k, v in doc.items() if v is not None and not isinstance(v, str))
    if bad:
        raise ConfigFileError(f"config file {path}: {', '.join(bad)} must be a string")
    return {str(k): v for k, v in doc.items() if v}


def write_config(updates: dict[str, str], path: Path | None = None) -> Path:
    """Set these keys in the config file, keeping the others (0600: it may hold a token or a password). A file that
    cannot be read back (ConfigFileError) is left as it is: it is the user's to fix, not to lose."""
    import yaml

    path = path or config_path()
    current = read_config(path)
    _write_private(path, yaml.safe_dump({**current, **updates}, sort_keys=False))
    return path


def setting(key: str) -> str | None:
    """One setting: its environment variable, else the config file."""
    env = os.environ.get(CONFIG_KEYS[key])
    if env:
        return env
    return read_config().get(key)


def state_dirs() -> list[Path | None]:
    """Where to look for a running `gpuq up`'s servers: this process's state directory (None: GPUQ_HOME, else `.gpuq`
    here); then, without GPUQ_HOME, the one the config file names (where the last `gpuq up` ran)."""
    dirs: list[Path | None] = [None]
    named = None if os.environ.get("GPUQ_HOME") else read_config().get("state_dir")
    if named:
        dirs.append(Path(named).expanduser())
    return dirs


def export_settings() -> None:
    """Put the config file's settings and the running platform's servers into the environment where it lacks
    them, for the commands that read NATS_URL, DATABASE_URL, GPUQ_API_URL or GPUQ_TOKEN there (options with an
    envvar, the services' own command modules)."""
    config = read_config()
    for key in ("nats_url", "database_url", "api_url", "token"):
        if not os.environ.get(CONFIG_KEYS[key]) and config.get(key):
            os.environ[CONFIG_KEYS[key]] = config[key]
    recorded: dict[str, Any] | None = None
    for key in _URLS:
        if not os.environ.get(CONFIG_KEYS[key]):
            recorded = _found() if recorded is None else recorded
            if isinstance(recorded.get(key), str):
                os.environ[CONFIG_KEYS[key]] = recorded[key]


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600, whatever the umask; as shared/natsauth.py's, which this light
    module does not import), atomically: the text goes to a new file beside it that then replaces it, so that two
    processes writing at once (several `gpuq up` started together) leave one whole file, never an interleaving of
    both (which left a config no command could read)."""
    import stat
    import tempfile

    path = path.resolve()  # a symlinked config (a dotfiles checkout) keeps its link: its target is replaced
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        # not a plain file (GPUQ_CONFIG=/dev/null, a pipe): written in place, never replaced by a file
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


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
    _write_private(CREDENTIALS_FILE, json.dumps({"pid": pid, **{k: info for k, (_, info) in plain.items()}}))
    _write_private(SERVERS_FILE, json.dumps({**{k: url for k, (url, _) in plain.items()}, "pid": pid}))
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


def _recorded(state_dir: Path | None = None) -> dict[str, Any]:
    """The servers file, its URLs with the credentials of the credentials file written with it (same pid)."""
    servers, credentials = ((SERVERS_FILE, CREDENTIALS_FILE) if state_dir is None else
                            (state_dir / SERVERS_FILE.name, state_dir / CREDENTIALS_FILE.name))
    recorded = _read(servers)
    if not recorded:
        return {}
    secrets = _read(credentials)
    if secrets.get("pid") == recorded.get("pid"):
        for key in _URLS:
            if isinstance(recorded.get(key), str) and isinstance(secrets.get(key), str):
                recorded[key] = join_userinfo(recorded[key], secrets[key])
    return recorded


def _found() -> dict[str, Any]:
    """The servers of the first state directory (state_dirs()) that records a `gpuq up`."""
    for directory in state_dirs():
        recorded = _recorded(directory)
        if recorded:
            return recorded
    return {}


def _url(key: str, what: str) -> str:
    try:
        url = setting(key) or _found().get(key)
    except ConfigFileError as exc:
        raise typer.BadParameter(str(exc), param_hint=CONFIG_ENV) from None
    if not url:
        raise typer.BadParameter(f"no {what}: set {CONFIG_KEYS[key]} or {key} in {config_path()}, or start the "
                                 "platform with `gpuq up` first", param_hint=CONFIG_KEYS[key])
    return str(url)


def database_url() -> str:
    return _url("database_url", "database")


def nats_url() -> str:
    return _url("nats_url", "NATS server")
