"""Liveness and readiness over HTTP: `/healthz` and `/readyz` for the services of one process.

A service is ready when it is connected to NATS and Postgres, its migrations are applied, and it either holds its
leader lease or stands by for it (a standby is a healthy replica: the Deployment counts it available and a rollout
proceeds). It is live unless Postgres has stayed unreachable for longer than the recovery bound while a singleton
takes its leases again (`shared.service.LEASE_RECOVERY_BOUND_S`; a supervisor then restarts it): a lost lease is
recovered in-process, so "not ready" is the normal report of a short outage. Each `ServiceRuntime.health()` reports
its own facts; this module combines them, and `HealthServer` serves the combination on one port for all the
services a `gpuq up` process runs.

FastAPI on uvicorn, inside the services' own event loop: the checks await the services' asyncpg pool and NATS
client, which belong to that loop (prometheus_client's HTTP server runs in a thread and could not await them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

log = logging.getLogger("gpuq.health")

# What a probe waits for one check at most: longer, and the answer is "not ready" (the probe has its own timeout).
CHECK_TIMEOUT_S = 2.0


class Check(BaseModel):
    ok: bool
    detail: str


class ConsumerState(BaseModel):
    """One durable consumer of a service: how many messages wait for it (not yet delivered, plus delivered and not yet
    acknowledged; None when the server did not answer), how long since its loop last settled a batch or found
    nothing to take, and whether it counts as stalled (messages wait and it has not advanced for longer than the
    service's stall threshold, or its loop has stopped, or it cannot take more)."""

    consumer: str
    waiting: int | None
    since_progress_s: float
    stalled: bool


# Where a service that uses queues.yaml leaves, in its runtime's `state`, a callable answering the ConfigInForce it
# runs on (services/stack.py puts it in the service's report).
CONFIG_STATE_KEY = "config_in_force"


class ConfigInForce(BaseModel):
    """The queue configuration a service runs on (docs/admission.md, "The configuration in force"): admission's
    version and its content hash, or no version (None) while none is recorded and the service runs on the queues.yaml
    it read at start; `file_differs` when that file is not the content it runs on (an old pod's ConfigMap in a
    rolling upgrade, or a new one admission has not recorded yet)."""

    version: int | None
    hash: str
    file_differs: bool = False
    detail: str = ""


class ServiceHealth(BaseModel):
    service: str
    # created → migrating → connecting → standby (singletons waiting for the lease) → starting → running →
    # stopping → stopped; a running singleton that loses a lease goes to recovering (consumption paused, the
    # leases being taken again: not ready), then standby or starting → running again; "not started" for a service
    # of this process that has no runtime yet.
    phase: str
    ready: bool
    live: bool
    checks: dict[str, Check]
    consumers: list[ConsumerState] = []
    dead_letters: int = 0  # messages this process dead-lettered since it started
    dead_letter_reasons: dict[str, int] = {}  # the same, per reason (InvalidEvent, MaxDeliveries, ...)
    config: ConfigInForce | None = None  # the queue configuration it runs on, for services that use queues.yaml


class HealthReport(BaseModel):
    ready: bool
    live: bool
    services: dict[str, ServiceHealth]
    # What an operator must hear about that does not make the process unready, e.g. `nats_auth`: the bus takes
    # clients without credentials (shared/busauth.py).
    warnings: dict[str, str] = {}


def service_health(service: str, phase: str, checks: dict[str, Check], *, live: bool = True,
                   consumers: Sequence[ConsumerState] = (), dead_letters: int = 0,
                   dead_letter_reasons: Mapping[str, int] | None = None) -> ServiceHealth:
    """Ready = every check passes and the service is past its start-up (standing by counts as ready)."""
    ready = phase in ("standby", "running") and all(c.ok for c in checks.values())
    return ServiceHealth(service=service, phase=phase, ready=ready, live=live, checks=checks,
                         consumers=list(consumers), dead_letters=dead_letters,
                         dead_letter_reasons=dict(sorted((dead_letter_reasons or {}).items())))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition(report: HealthReport) -> str:
    """The report as Prometheus metrics (text format 0.0.4), served on `/metrics` beside the probes: each service's
    readiness, dead letters and queue configuration version (and whether its queues.yaml differs), and each
    consumer's waiting messages, time since it advanced, and whether it is stalled (an alert on
    `gpuq_consumer_stalled == 1` names the consumer that /readyz reports)."""
    lines = [
        "# HELP gpuq_service_ready Whether the service is ready (1) or not (0), as /readyz reports it.",
        "# TYPE gpuq_service_ready gauge",
        *(f'gpuq_service_ready{{service="{_label(name)}"}} {int(s.ready)}' for name, s in report.services.items()),
        "# HELP gpuq_dead_letters_total Messages the service dead-lettered since its process started, per reason "
        "(reason=\"\" while it has dead-lettered none: the series exists from the start).",
        "# TYPE gpuq_dead_letters_total counter",
        *(f'gpuq_dead_letters_total{{service="{_label(name)}",reason="{_label(reason)}"}} {count}'
          for name, s in report.services.items()
          for reason, count in (s.dead_letter_reasons.items() if s.dead_letter_reasons else [("", s.dead_letters)])),
    ]
    configured = [(name, s.config) for name, s in report.services.items() if s.config is not None]
    if configured:
        lines += [
            "# HELP gpuq_config_version The queue configuration version the service runs on (0: none recorded yet, "
            "it runs on its queues.yaml).",
            "# TYPE gpuq_config_version gauge",
            *(f'gpuq_config_version{{service="{_label(name)}"}} {c.version or 0}' for name, c in configured),
            "# HELP gpuq_config_file_differs 1 when the service's queues.yaml is not the configuration it runs on.",
            "# TYPE gpuq_config_file_differs gauge",
            *(f'gpuq_config_file_differs{{service="{_label(name)}"}} {int(c.file_differs)}' for name, c in configured),
        ]
    consumers = [(name, c) for name, s in report.services.items() for c in s.consumers]
    for metric, kind, what, value in (
            ("gpuq_consumer_waiting_messages", "gauge",
             "Messages waiting for the consumer: not yet delivered, or delivered and not yet acknowledged.",
             lambda c: c.waiting),
            ("gpuq_consumer_seconds_since_progress", "gauge",
             "Seconds since the consumer last settled a batch or found nothing to take.",
             lambda c: round(c.since_progress_s, 3)),
            ("gpuq_consumer_stalled", "gauge",
             "1 when messages wait and the consumer has not advanced for longer than its threshold, or it stopped.",
             lambda c: int(c.stalled))):
        lines += [f"# HELP {metric} {what}", f"# TYPE {metric} {kind}"]
        lines += [f'{metric}{{service="{_label(name)}",consumer="{_label(c.consumer)}"}} {value(c)}'
                  for name, c in consumers if value(c) is not None]
    return "\n".join(lines) + "\n"


def not_started(service: str) -> ServiceHealth:
    return ServiceHealth(service=service, phase="not started", ready=False, live=True,
                         checks={"runtime": Check(ok=False, detail="not started yet")})


def combine(reports: Sequence[ServiceHealth], expected: Sequence[str] = (),
            warnings: dict[str, str] | None = None) -> HealthReport:
    """One process's report: ready when every service it runs (`expected`, started or not) is ready; `warnings`
    are reported as they are and change neither."""
    services = {r.service: r for r in reports}
    for name in expected:
        services.setdefault(name, not_started(name))
    ordered = {name: services[name] for name in sorted(services)}
    return HealthReport(ready=bool(ordered) and all(s.ready for s in ordered.values()),
                        live=all(s.live for s in ordered.values()), services=ordered, warnings=dict(warnings or {}))


async def timed_check(probe: Awaitable[Any], ok_detail: str, what: str) -> Check:
    """Run one probe with the check timeout; any failure is a failed check that says why."""
    try:
        result = await asyncio.wait_for(probe, timeout=CHECK_TIMEOUT_S)
    except TimeoutError:
        return Check(ok=False, detail=f"{what}: no answer within {CHECK_TIMEOUT_S:g} s")
    except Exception as exc:
        return Check(ok=False, detail=f"{what}: {type(exc).__name__}: {exc}")
    if result is False:
        return Check(ok=False, detail=f"{what}: not connected")
    return Check(ok=True, detail=ok_detail)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is a clear error naming it (uvicorn would exit)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve the health endpoints on {host}:{port}: {exc.strerror}") from exc
    sock.listen(64)
    sock.setblocking(False)
    return sock


class HealthServer:
    """Serves `/healthz` (200 while live, else 503) and `/readyz` (200 when ready, else 503) with the JSON report.

    Use as an async context manager around the services, so the endpoints answer while they start (a standby
    waits for its lease inside start-up) and while they stop.
    """

    def __init__(self, report: Callable[..., Awaitable[HealthReport]], *, host: str = "0.0.0.0", port: int = 8080):
        # report(connections=True) for /readyz; report(connections=False) for /healthz, which must answer without
        # waiting on NATS or Postgres: an outage of theirs is no reason to restart gpuq.
        self.report = report
        self.host = host
        self.port = port
        self.bound_port: int | None = None
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    def app(self) -> Any:
        # Imported here: only processes that serve the endpoints pay for FastAPI's import.
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse

        app = FastAPI(title="gpuq health", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/healthz")
        async def healthz() -> JSONResponse:
            report = await self.report(connections=False)
            body = {"live": report.live,
                    "services": {name: {"phase": s.phase, "live": s.live} for name, s in report.services.items()}}
            return JSONResponse(body, status_code=200 if report.live else 503)

        @app.get("/readyz")
        async def readyz() -> JSONResponse:
            report = await self.report(connections=True)
            return JSONResponse(report.model_dump(), status_code=200 if report.ready else 503)

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            report = await self.report(connections=True)
            return PlainTextResponse(exposition(report), media_type="text/plain; version=0.0.4; charset=utf-8")

        return app

    async def start(self) -> int:
        import uvicorn

        class EmbeddedServer(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # The host process owns SIGTERM/SIGINT (gpuq up stops its services on them); uvicorn's own handlers
                # would replace the event loop's.
                yield

        sock = bind_socket(self.host, self.port)
        self.bound_port = int(sock.getsockname()[1])
        # log_config=None: uvicorn's records go through the process's own logging set-up, which it leaves alone.
        config = uvicorn.Config(self.app(), log_config=None, log_level="warning", access_log=False, lifespan="off")
        self._server = EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gpuq-health")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the health server stopped at start")
            await asyncio.sleep(0.01)
        log.info("health endpoints on %s:%d (/healthz, /readyz)", self.host, self.bound_port)
        return self.bound_port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=5)
        self._server = self._task = None

    async def __aenter__(self) -> HealthServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
