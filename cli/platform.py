"""Operators' commands: `gpuq up` (run the services long-lived) and `gpuq demo` (the whole platform on a
synthetic Philly-shaped workload at accelerated time, ending with a report)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import signal
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape

from cli.output import Column, OutputFormat, render_table
from cli.runtime import (
    STATE_DIR,
    ConfigFileError,
    active_instance,
    config_path,
    forget_servers,
    record_servers,
    write_config,
)

if TYPE_CHECKING:
    from services.stack import Stack

# The services' modules are imported in the functions that run them: `gpuq up --help` (and every other command's
# start) does not pay for them. services.stack.ALL_SERVICES, as `--services`' default (tests/unit/cli checks so).
ALL_SERVICES = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit", "api")

console = Console()
EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"


def up(
    cluster: Path | None = typer.Option(
        None, help="cluster.yaml: the simulated cluster (default: deploy/examples/cluster.yaml), or with "
                   "--executor kube the node mapping (source: kubernetes; default: the built-in mapping)"),
    executor: str = typer.Option("sim", help="sim: a simulated cluster (nothing really runs); kube: run jobs on "
                                             "Kubernetes"),
    kubeconfig: Path | None = typer.Option(
        None, help="kubeconfig for --executor kube and for the API's TokenReview (GPUQ_API_TOKEN_REVIEW; default: "
                   "the in-cluster service account)"),
    queues: Path = typer.Option(EXAMPLES / "queues.yaml", help="queues.yaml: teams, quotas, policy"),
    services: str = typer.Option(",".join(ALL_SERVICES), help="Comma-separated services to run here"),
    data_dir: Path = typer.Option(STATE_DIR, help="Where embedded NATS/Postgres keep their data"),
    speedup: float = typer.Option(1.0, help="Run the services' clock this many times faster (simulation)"),
    metrics_port: int = typer.Option(9464, help="Port of telemetry's Prometheus /metrics"),
    admission_cohorts: str = typer.Option(
        "", envvar="GPUQ_ADMISSION_COHORTS",
        help="Comma-separated cohorts this admission instance serves ('-' = queues without a cohort); "
             "empty = all cohorts"),
    health_port: int = typer.Option(
        8080, envvar="GPUQ_HEALTH_PORT",
        help="Port of /healthz (liveness) and /readyz (readiness) for all the services run here; 0 = none"),
    bind: str = typer.Option(
        "127.0.0.1", "--bind", envvar="GPUQ_BIND",
        help="Address the API, telemetry's /metrics and the health endpoints listen on: 127.0.0.1 (default) is this "
             "machine only; 0.0.0.0 is every interface (a container: the image and the Helm chart set it)"),
    health_addr: str = typer.Option("", envvar="GPUQ_HEALTH_ADDR",
                                    help="Address the health endpoints bind; default: --bind's"),
    metrics_job_labels: bool = typer.Option(
        False, "--metrics-job-labels", envvar="GPUQ_METRICS_JOB_LABELS",
        help="Export telemetry's per-job gauges (gpuq_job_*, labelled with job ids; the ML engineers' dashboard "
             "needs them): off by default, since whoever reaches /metrics reads every team's job ids there"),
    instance: str = typer.Option(
        "0", envvar="GPUQ_INSTANCE",
        help="This process's name in its events' source (gpuq/<service>/<instance>); the Helm chart sets the pod's"),
    api_port: int = typer.Option(8000, envvar="GPUQ_API_PORT", help="Port of the API service (HTTP)"),
    log_level: str = typer.Option("INFO", help="Logging level"),
) -> None:
    """Run the services until interrupted. Uses NATS_URL / DATABASE_URL when set (NATS_URL carries this process's
    bus credentials on an authenticated server), else embedded servers, whose NATS gets a bus user per service and
    per team (docs/security.md).
    Serves /healthz and /readyz (JSON, per service) on --health-port while the services start, run and stop.

    By default the executor is simulated (jobs "run" on the nodes of cluster.yaml and nothing is started);
    `--executor kube` runs them on the Kubernetes cluster of `--kubeconfig` (docs/kubernetes.md)."""
    from services.admission.sharding import parse_cohorts
    from services.stack import StackSettings
    from shared.clock import ScaledClock, SystemClock

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if executor not in ("sim", "kube"):
        console.print(f"[red]--executor must be sim or kube, not {executor!r}[/]")
        raise typer.Exit(2)
    wanted = [s.strip() for s in services.split(",") if s.strip()]
    health_addr = _check_listeners(wanted, bind=bind, health_addr=health_addr, api_port=api_port,
                                   metrics_port=metrics_port, health_port=health_port)
    runs_executor = "executor" in wanted
    if executor == "sim":
        cluster = cluster or EXAMPLES / "cluster.yaml"
    _announce_exposure(executor, runs_executor, cluster, kubeconfig, bind, health_addr)
    cluster_cfg, queues_cfg, dcgm = _load_configs(cluster, queues)
    _check_kubernetes_and_retention(wanted, executor, runs_executor, kubeconfig)
    servers = _servers(data_dir, queues_cfg)
    pointed = record_servers(servers.nats_url, servers.database_url) and _point_config_here()
    settings = StackSettings(
        nats_url=servers.nats_url, database_url=servers.database_url, queues=queues_cfg, cluster=cluster_cfg,
        cluster_dir=cluster.parent if cluster is not None else None, executor=executor, kubeconfig=kubeconfig,
        services=wanted,
        clock=ScaledClock(speedup) if speedup != 1.0 else SystemClock(), metrics_port=metrics_port, bind=bind,
        metrics_job_labels=metrics_job_labels,
        admission_cohorts=parse_cohorts(admission_cohorts), instance=instance, api_port=api_port,
        nats_urls=_service_urls(servers, executor), dcgm=dcgm)
    try:
        asyncio.run(_run_stack(settings, servers, health_addr=health_addr, health_port=health_port,
                               wanted=wanted, bind=bind, api_port=api_port, pointed=pointed))
    finally:
        servers.close()
        forget_servers()


def _check_listeners(wanted: list[str], *, bind: str, health_addr: str, api_port: int, metrics_port: int,
                     health_port: int) -> str:
    """The addresses and ports the services run here would listen on, checked before anything starts (exit 2
    naming the option); the health endpoints' address (default: --bind's)."""
    for option, address in (("--bind", bind), ("--health-addr", health_addr)):
        if address and not _is_ip(address):
            console.print(f"[red]{option} must be an IP address (127.0.0.1, 0.0.0.0, ::1, ...), not {address!r}[/]")
            raise typer.Exit(2)
    health_addr = health_addr or bind
    busy = _busy_port(bind, health_addr, [
        (api_port, "the API", "--api-port") if "api" in wanted else None,
        (metrics_port, "telemetry's /metrics", "--metrics-port") if "telemetry" in wanted and metrics_port else None,
        (health_port, "the health endpoints", "--health-port") if health_port else None])
    if busy is not None:
        console.print(f"[red]error:[/] {busy}", soft_wrap=True)
        raise typer.Exit(2)
    return health_addr


def _announce_exposure(executor: str, runs_executor: bool, cluster: Path | None, kubeconfig: Path | None,
                       bind: str, health_addr: str) -> None:
    """Say what `gpuq up` runs jobs on, and when its endpoints are reachable from other machines."""
    if executor == "sim":
        if runs_executor:
            console.print(f"gpuq up: SIMULATED executor: jobs run on the simulated nodes of {cluster}, not on a "
                          "real cluster (use --executor kube for Kubernetes)", soft_wrap=True)
    elif runs_executor:
        console.print("gpuq up: Kubernetes executor, "
                      + (f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"), soft_wrap=True)
    if not ipaddress.ip_address(bind).is_loopback:
        what = "the API, /metrics and the health endpoints" if health_addr == bind else "the API and /metrics"
        console.print(f"gpuq up: {what} listen on {bind}, reachable from other machines (--bind 127.0.0.1 keeps "
                      "them to this one)", soft_wrap=True)


def _load_configs(cluster: Path | None, queues: Path) -> tuple[Any, Any, Any]:
    """cluster.yaml (or the built-in Kubernetes mapping), queues.yaml and the DCGM settings, checked before anything
    starts (exit 2 naming what is wrong); prints queues.yaml's capacity warnings."""
    from shared.config import ClusterSource, ConfigError, dcgm_settings, load_cluster, load_queues, parse_cluster

    try:
        cluster_cfg = load_cluster(cluster) if cluster is not None else parse_cluster(
            {"source": "kubernetes"}, "built-in Kubernetes mapping")
        queues_cfg = load_queues(queues)
        dcgm = dcgm_settings(cluster_cfg, os.environ)  # GPUQ_DCGM_PROMETHEUS_URL etc., checked before starting
    except ConfigError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None
    # Capacity warnings need the nodes, which a `source: kubernetes` cluster.yaml does not list.
    for warning in queues_cfg.warnings(cluster_cfg if cluster_cfg.source is ClusterSource.STATIC else None):
        console.print(f"[yellow]warning:[/] {warning}")
    return cluster_cfg, queues_cfg, dcgm


def _check_kubernetes_and_retention(wanted: list[str], executor: str, runs_executor: bool,
                                    kubeconfig: Path | None) -> None:
    """The settings read from the environment and the kubeconfig, checked before anything starts (exit 2)."""
    from shared import gcpolicy, retention

    reviews_tokens = False
    if "api" in wanted:
        from services.api.kubeauth import TokenReviewSettings

        try:
            reviews_tokens = TokenReviewSettings.from_env().enabled
        except ValueError as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(2) from None
    if (executor == "kube" and runs_executor) or reviews_tokens:
        from services.executor.kube.client import load_config

        try:
            load_config(kubeconfig)
        except Exception as exc:  # lightkube raises its own ConfigError, or OSError, for what cannot be read
            where = str(kubeconfig) if kubeconfig else "the in-cluster service account"
            console.print(f"[red]cannot use {where} to reach Kubernetes: {escape(str(exc))}[/]")
            raise typer.Exit(2) from None
    try:
        gcpolicy.thaw_setting()
        for window in (retention.METERING_RAW, retention.AUDIT):  # GPUQ_*_RETENTION_DAYS, with their floors
            window.days(os.environ)
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None


def _servers(data_dir: Path, queues_cfg: Any) -> Any:
    """NATS and Postgres: NATS_URL / DATABASE_URL, another `gpuq up`'s, or embedded ones started here."""
    from shared.servers import EmbeddedServerError, Servers, resolve_servers

    active = active_instance()
    if active is not None and not os.environ.get("NATS_URL") and not os.environ.get("DATABASE_URL"):
        # Another `gpuq up` runs with this state directory: share its servers (starting embedded ones on the same
        # data directories would corrupt them) and leave its servers file alone.
        console.print(f"gpuq up: another gpuq up (pid {active['pid']}) runs with {STATE_DIR}; using its NATS and "
                      "Postgres", soft_wrap=True)
        return Servers(nats_url=str(active["nats_url"]), database_url=str(active["database_url"]),
                       origin={"nats": f"of pid {active['pid']}", "postgres": f"of pid {active['pid']}"})
    try:
        return resolve_servers(data_dir, teams=_teams(queues_cfg))
    except EmbeddedServerError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(2) from None


async def _run_stack(settings: Any, servers: Any, *, health_addr: str, health_port: int, wanted: list[str],
                     bind: str, api_port: int, pointed: bool) -> None:
    """Run the stack (and the health endpoints) until SIGINT or SIGTERM, then stop it."""
    from services.stack import Stack
    from shared import gcpolicy
    from shared import namespace as namespaces
    from shared.health import HealthServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stack = Stack(settings)
    # Health first: a standby waits for its lease inside the stack's start-up, and reports so meanwhile.
    health = HealthServer(stack.health, host=health_addr, port=health_port) if health_port else None
    async with health or contextlib.nullcontext():
        # A signal must stop a standby too, which is still inside start-up (waiting for the lease): a pod
        # would otherwise be killed only at the end of its termination grace period.
        starting = asyncio.create_task(stack.start())
        stopping = asyncio.create_task(stop.wait())
        announcing = asyncio.create_task(_announce_standby(stack))
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # start-up errors end the command here
                gcpolicy.install()  # services started: their long-lived heap is loaded (shared/gcpolicy.py)
                names = ", ".join(r.spec.name for r in stack.runtimes)
                console.print(f"gpuq up: {names} in namespace {namespaces.current()} "
                              f"(NATS {servers.origin['nats']}, Postgres {servers.origin['postgres']})")
                for line in _ready_lines(wanted, bind, api_port, pointed):
                    console.print(f"gpuq up: {line}", soft_wrap=True)
                await stopping
        finally:
            for task in (starting, stopping, announcing):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting  # its error, if any, was raised above
            await stack.stop()
            gcpolicy.uninstall()
    console.print("stopped")


async def _announce_standby(stack: Stack) -> None:
    """Say so when a service of this process waits as a standby (another instance holds its lease), and when it
    takes over: a silent standby looks hung."""
    announced: set[str] = set()
    while True:
        runtime = stack.starting
        # "standby" is the phase from the first attempt at the lease on: only a refusal (another instance holds
        # it) makes this one a standby; a fresh start that takes the lease at once says nothing.
        if (runtime is not None and runtime.phase == "standby" and getattr(runtime, "lease_refusals", 1) > 0
                and runtime.spec.name not in announced):
            announced.add(runtime.spec.name)
            console.print(f"gpuq up: STANDBY: another instance holds the {runtime.spec.name} lease; this one takes "
                          "over when it goes (Ctrl-C or SIGTERM stops it)", soft_wrap=True)
        for name in sorted(announced):
            if any(r.spec.name == name and r.phase == "running" for r in stack.runtimes):
                announced.discard(name)
                console.print(f"gpuq up: {name} took over the lease: active now", soft_wrap=True)
        await asyncio.sleep(0.2)


def _busy_port(bind: str, health_addr: str, ports: list[tuple[int, str, str] | None]) -> str | None:
    """The first of these ports something else already listens on, in words (what it is for and the option that
    moves it), else None. Checked before anything starts: a service failing to bind halfway through start-up
    leaves tracebacks from every service it stops."""
    import socket

    for entry in ports:
        if entry is None:
            continue
        port, what, option = entry
        address = health_addr if option == "--health-port" else bind
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
            try:
                probe.bind((address, port))
            except OSError as exc:
                why = "already in use" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else exc.strerror
                return (f"port {port} on {address} ({what}) is {why}: stop what uses it (`ss -ltnp 'sport = :{port}'` "
                        f"names it), or give {option} another port")
    return None


def _point_config_here() -> bool:
    """Name this state directory in the config file, so that commands run from any directory find these servers."""
    try:
        write_config({"state_dir": str(STATE_DIR.resolve())})
        return True
    except (OSError, ConfigFileError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        console.print(f"[yellow]warning:[/] cannot record the state directory in {config_path()} ({why}): "
                      f"admin commands find this platform only from {Path.cwd()} (or with GPUQ_HOME={STATE_DIR})",
                      soft_wrap=True)
        return False


def _ready_lines(wanted: list[str], bind: str, api_port: int, pointed: bool) -> list[str]:
    """Where the API is and how to start using it, once the services run."""
    lines = []
    if "api" in wanted:
        host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
        url = f"http://[{host}]:{api_port}" if ":" in host else f"http://{host}:{api_port}"
        lines.append(f"API at {url} (docs: {url}/docs); a token: `gpuq tokens create NAME --team TEAM`, then "
                     f"export GPUQ_API_URL={url} GPUQ_TOKEN=<the token>")
    if pointed:
        lines.append(f"admin commands (gpuq status, queues, report, ...) find this platform from any directory "
                     f"through {config_path()}")
    lines.append("Ctrl-C stops it")
    return lines


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _teams(config: Any) -> list[str]:
    return sorted({t for q in config.queues for t in q.teams} | set(config.governance.teams))


def _service_urls(servers: Any, executor: str = "sim") -> dict[str, str]:
    """Each service on its own bus credential when this process started the (authenticated) embedded NATS. The
    Kubernetes executor is also the intake of workloads: it uses the `kube` user, which may submit for teams."""
    from shared.natsauth import KUBE, SERVICES

    if servers.nats_auth is None:
        return {}
    urls = {name: servers.nats_url_for(name) for name in SERVICES}
    if executor == "kube":
        urls["executor"] = servers.nats_url_for(KUBE)
    return urls


DEMO_CLUSTER = {"node_groups": [
    {"name": "gpu", "count": 16, "gpus_per_node": 8, "gpu_model": "A100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 4, "racks_per_block": 2, "labels": {"pool": "training"}},
]}
DEMO_TEAMS = ("vision", "speech", "nlp", "recsys")
DEMO_QUEUES = {
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "normal", "value": 100, "preemptible": True},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [{"name": t, "cohort": "research", "teams": [t], "weight": w,
                "quotas": {"A100-80GB": {"nominal": q, "borrowing_limit": None, "lending_limit": None}}}
               for t, w, q in (("vision", 1, 48), ("speech", 1, 32), ("nlp", 2, 32), ("recsys", 1, 16))],
    "gpu_flavors": {"A100-80GB": {"weight": 2.5, "cost_per_gpu_hour": 2.60}},
    "policy": {"protection_window_s": 600, "checkpoint_grace_s": 300},
}


def demo(
    jobs: int = typer.Option(300, help="Jobs in the synthetic workload"),
    speedup: float = typer.Option(400.0, help="Virtual seconds per wall second"),
    load: float = typer.Option(0.9, help="Offered load on the demo cluster"),
    seed: int = typer.Option(7, help="Workload seed"),
    time_limit: float = typer.Option(150.0, help="Stop waiting for stragglers after this many wall seconds"),
    namespace: str = typer.Option(
        "", help="Platform namespace of the demo's streams and subjects; default: a fresh `demo-<random>` one, so "
                 "the demo never meets another platform's streams on a shared NATS"),
    reset: bool = typer.Option(
        False, "--reset", help="Delete the streams of --namespace first; refused unless an earlier demo created "
                               "them (a platform's streams are never deleted)"),
    keep: bool = typer.Option(False, "--keep", help="Keep the demo's streams and database afterwards"),
) -> None:
    """Start everything on embedded servers (or NATS_URL/DATABASE_URL), replay a synthetic Philly-shaped
    workload through the bus at accelerated time, and print a report.

    On servers it is given, the demo only ever touches what it creates: a fresh namespace (streams and subjects)
    and a fresh database, both removed at the end unless --keep."""
    from shared import namespace as namespaces
    from shared.config import parse_cluster, parse_queues
    from shared.servers import resolve_servers

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if reset and not namespace:
        console.print("[red]--reset needs --namespace: without it the demo uses a fresh namespace, which has "
                      "nothing to reset[/]")
        raise typer.Exit(2)
    try:
        ns = namespaces.validate(namespace) if namespace else namespaces.fresh("demo")
    except namespaces.NamespaceError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    os.environ[namespaces.ENV] = ns  # this process (and the services it runs) publish in the demo's namespace
    cluster_cfg = parse_cluster(DEMO_CLUSTER, "demo cluster")
    queues_cfg = parse_queues(DEMO_QUEUES, "demo queues")
    capacity = cluster_cfg.total_gpus
    # The demo's workload generator is the simulator's (pure Python: it needs no extra); imported here so that
    # `gpuq up` in the service image never loads the simulator.
    from sim.synthetic_workload import generate

    workload = generate(teams=list(DEMO_TEAMS), jobs=jobs, capacity_gpus=capacity, load=load, seed=seed,
                        max_duration_s=3 * 3_600.0)
    with tempfile.TemporaryDirectory(prefix="gpuq-demo-") as tmp:
        servers = resolve_servers(Path(tmp), teams=DEMO_TEAMS)
        try:
            console.print(f"[bold]gpuq demo[/]: {jobs} jobs on {capacity} GPUs, {speedup:g}× time, namespace {ns} "
                          f"(NATS {servers.origin['nats']}, Postgres {servers.origin['postgres']})")
            asyncio.run(_demo_on_own_resources(servers.nats_url, servers.database_url, ns, reset, keep, cluster_cfg,
                                               queues_cfg, workload, speedup, time_limit, _service_urls(servers)))
        except DemoRefused as exc:
            console.print(f"[red]gpuq demo refused:[/] {exc}")
            raise typer.Exit(2) from None
        finally:
            servers.close()


class DemoRefused(RuntimeError):
    """The demo would have to touch streams or a database it did not create."""


async def _demo_on_own_resources(nats_url: str, database_url: str, ns: str, reset: bool, keep: bool,
                                 cluster_cfg: Any, queues_cfg: Any, workload: list[Any], speedup: float,
                                 time_limit: float, service_urls: dict[str, str] | None = None) -> None:
    """Claim a namespace and a database for the demo, run it, then remove both unless `keep`."""
    import nats

    from shared.bus import NamespaceInUse, delete_streams, ensure_streams, namespace_purposes
    from shared.db import drop_database

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        existing = await namespace_purposes(js, ns)
        if existing:
            if not reset:
                raise DemoRefused(f"namespace {ns!r} already has streams ({', '.join(sorted(existing))}); pass "
                                  "--reset to start it afresh (allowed only for an earlier demo's streams), or "
                                  "choose another --namespace")
            try:
                await delete_streams(js, ns, purpose="demo")
            except NamespaceInUse as exc:
                raise DemoRefused(str(exc)) from None
        await ensure_streams(js, ns, purpose="demo")
        demo_db_url, created_db = await _demo_database(database_url)
        try:
            await _run_demo(nats_url, demo_db_url, cluster_cfg, queues_cfg, workload, speedup, time_limit,
                            service_urls or {})
        finally:
            if keep:
                console.print(f"kept namespace {ns} and database {demo_db_url.rsplit('/', 1)[-1]}")
            else:
                if created_db is not None:
                    await drop_database(database_url, created_db)
                await delete_streams(js, ns, purpose="demo")
    finally:
        await nc.close()


async def _demo_database(database_url: str) -> tuple[str, str | None]:
    """A fresh database for the demo on the given server: (its URL, its name to drop afterwards). Where the role
    may not create databases, the given database is used only if it holds no gpuq schemas."""
    import asyncpg

    from services.stack import ALL_SERVICES
    from shared.db import redact, scratch_database

    try:
        return await scratch_database(database_url, "gpuq_demo")
    except asyncpg.InsufficientPrivilegeError:
        pass
    conn = await asyncpg.connect(database_url)
    try:
        present = [r["nspname"] for r in await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY($1::text[]) ORDER BY nspname", list(ALL_SERVICES))]
    finally:
        await conn.close()
    if present:
        raise DemoRefused(f"the database of DATABASE_URL ({redact(database_url)}) already holds gpuq schemas "
                          f"({', '.join(present)}) and this role may not create a database of the demo's own; "
                          "the demo never resets a database it did not create: point DATABASE_URL at an empty "
                          "database, or unset it to use an embedded Postgres")
    return database_url, None


async def _run_demo(nats_url: str, database_url: str, cluster_cfg: Any, queues_cfg: Any, workload: list[Any],
                    speedup: float, time_limit: float, service_urls: dict[str, str]) -> None:
    import nats
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from services.stack import ALL_SERVICES, Stack, StackSettings
    from shared.clock import ScaledClock
    from shared.events import JobSubmitted, utcnow_from
    from shared.service import publish_event
    from shared.tracing import traced_event

    clock = ScaledClock(speedup)
    # The demo runs no API server (it would take a port): the users' side is its own submissions.
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=queues_cfg, cluster=cluster_cfg,
                             clock=clock, nats_urls=service_urls,
                             services=[s for s in ALL_SERVICES if s != "api"])
    origin = clock.now()
    wall0 = time.monotonic()
    async with Stack(settings) as stack:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        total = len(workload)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            submitted_task = progress.add_task("submitted", total=total)
            done_task = progress.add_task("finished ", total=total)
            running_task = progress.add_task("running  ", total=None)
            i = 0
            while True:
                now = clock.now()
                while i < total and origin + workload[i].submit_offset_s <= now:
                    job = workload[i]
                    at = utcnow_from(origin + job.submit_offset_s)
                    # each demo job starts a trace of its own at its submission, on its team's subject
                    await publish_event(js, traced_event(JobSubmitted(spec=job.spec, submitted_at=at),
                                                         source="gpuq-demo", time=at),
                                        JobSubmitted.scoped_subject(job.spec.team))
                    i += 1
                progress.update(submitted_task, completed=i)
                counts = await _state_counts(database_url)
                finished = counts.get("completed", 0) + counts.get("failed", 0) + counts.get("rejected", 0) + \
                    counts.get("cancelled", 0)
                progress.update(done_task, completed=finished)
                progress.update(running_task, description=f"running {counts.get('running', 0):>4}  pending "
                                f"{counts.get('pending', 0) + counts.get('admitted', 0):>4}")
                if i == total and finished >= total:
                    break
                if time.monotonic() - wall0 > time_limit:
                    console.print(f"[yellow]time limit reached: {total - finished} job(s) still active[/]")
                    break
                await asyncio.sleep(0.25)
        await nc.close()
        end = clock.now()
        await _report(database_url, cluster_cfg.total_gpus, origin, end, stack)


async def _state_counts(database_url: str) -> dict[str, int]:
    from services.api.readmodel import fetch_status

    rows = await fetch_status(database_url, None)
    out: dict[str, int] = {}
    for r in rows:
        out[r["state"]] = out.get(r["state"], 0) + 1
    return out


async def _report(database_url: str, capacity: int, origin: float, end: float, stack: Stack) -> None:
    import asyncpg

    from services.api.readmodel import fetch_status

    rows = await fetch_status(database_url, None)
    conn = await asyncpg.connect(database_url)
    runs = {r["job_id"]: r for r in await conn.fetch(
        "SELECT job_id, gpus, started_at, ends_at, status FROM executor.runs")}
    await conn.close()
    span = max(1.0, end - origin)
    gpu_s = sum(r["gpus"] * (min(r["ends_at"], end) - r["started_at"]) for r in runs.values()
                if r["status"] != "running") + sum(r["gpus"] * (end - r["started_at"]) for r in runs.values()
                                                   if r["status"] == "running")
    table: list[list[str]] = []  # one row per team, then "all" (cli/output.py: nothing cut at any width)
    # GPU-hours per team from the metering ledger, as `gpuq report --by team` and the metering table count them
    # (services/metering/report.py, team_gpu_hours); the executor's runs only without a ledger.
    ledger_hours = await _ledger_team_hours(database_url)
    teams = sorted({r["team"] for r in rows})
    waits_all: list[float] = []
    for team in [*teams, "all"]:
        mine = [r for r in rows if team in ("all", r["team"])]
        waits = [r["placed_at"] - r["submitted_at"] for r in mine if r.get("placed_at")]
        if team != "all":
            waits_all.extend(waits)
        if ledger_hours is not None:
            hours = sum(h for t, h in ledger_hours.items() if team in ("all", t))
        else:
            hours = sum(runs[r["job_id"]]["gpus"] * (min(runs[r["job_id"]]["ends_at"], end) -
                                                     runs[r["job_id"]]["started_at"])
                        for r in mine if r["job_id"] in runs) / 3600
        table.append([team, str(len(mine)), str(sum(r["state"] == "completed" for r in mine)),
                      str(sum(r["state"] == "failed" for r in mine)), str(sum(r["state"] == "rejected" for r in mine)),
                      f"{statistics.fmean(waits):.0f}" if waits else "-",
                      f"{statistics.quantiles(waits, n=10)[-1]:.0f}" if len(waits) >= 10 else "-", f"{hours:.1f}"])
    hours_column = Column("allocated GPU-h" if ledger_hours is not None else "GPU-hours", justify="right")
    render_table([*DEMO_COLUMNS, hours_column], table[:-1], totals=table[-1:], fmt=OutputFormat.TABLE,
                 console=console, title=f"gpuq demo report: {span / 3600:.1f} virtual hours, {capacity} GPUs")
    console.print(f"GPU utilisation (allocated GPU-seconds ÷ capacity over the run): "
                  f"[bold]{gpu_s / (capacity * span):.1%}[/]")
    await _metering_table(database_url)
    counters = {r.spec.name: r.counters for r in stack.runtimes}
    dead = sum(c.dead_lettered for c in counters.values())
    console.print(f"events handled: {sum(c.handled for c in counters.values())}, duplicates skipped: "
                  f"{sum(c.duplicates for c in counters.values())}, dead-lettered: {dead}")
    console.print(f"finished at {datetime.now(UTC):%H:%M:%S} UTC")


async def _ledger_team_hours(database_url: str) -> dict[str, float] | None:
    """Allocated GPU-hours per team from the metering ledger; None when this platform keeps none."""
    try:
        from services.metering.report import ReportError, team_gpu_hours
    except ImportError:
        return None
    try:
        return await team_gpu_hours(database_url, now=datetime.now(UTC))
    except ReportError:
        return None


async def _metering_table(database_url: str) -> None:
    """The metering ledger's view per team, when the metering service ran."""
    import asyncpg

    try:
        from services.metering.store import team_summary
    except ImportError:
        return
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        rows = await team_summary(pool)
    except asyncpg.UndefinedTableError:
        return
    finally:
        await pool.close()
    render_table(METERING_COLUMNS, [[str(r.get("team")), *(f"{float(r.get(k) or 0):.1f}" for k in
                                                          ("allocated_gpu_hours", "used_gpu_hours", "idle_gpu_hours")),
                                     f"{float(r.get('cost') or 0):.2f}"] for r in rows],
                 fmt=OutputFormat.TABLE, console=console, title="metering per team")


# The demo's tables (cli/output.py): at a narrow terminal the less telling figures are left out, nothing is cut.
DEMO_COLUMNS = (Column("team"), Column("jobs", justify="right"), Column("completed", justify="right"),
                Column("failed", justify="right", drop=3), Column("rejected", justify="right", drop=2),
                Column("avg wait s", justify="right"), Column("p90 wait s", justify="right", drop=1))
METERING_COLUMNS = (Column("team"), Column("allocated GPU-h", justify="right"),
                    Column("used GPU-h", justify="right"), Column("idle GPU-h", justify="right", drop=1),
                    Column("cost", justify="right"))
