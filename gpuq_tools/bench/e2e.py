"""`gpuq bench e2e`: the running platform end to end, driven through NATS as producers drive it.

It starts a stack (or attaches to one with `--attach`), publishes `JobSubmitted` events on the teams' submission
subjects, and watches `JobAdmitted` and `JobPlaced` go by on the bus. It prints one JSON object: placements/s and
admissions/s, submit→admitted and submit→placed p50/p99, events on the bus and consumer deliveries per job, CPU
and RSS of the gpuq process(es), and the CPU the Postgres server processes used meanwhile (all Postgres processes
of this machine: on a shared machine that includes other users' load).

Unless attached, it also reports the run's footprint, for sizing (`sizing`): each service process's CPU seconds
since it started and its peak RSS; the run's own database (its growth, rows and bytes per schema and table,
pg_stat_database's counters, the CPU of the backends serving it, its peak connections); its streams (messages and
bytes); and, with `--own-nats`, the NATS server it started for itself (CPU seconds, peak RSS, traffic, store).

Scenarios:
- `burst`: `--jobs` 1-GPU jobs at once on `--nodes` nodes × 8 GPUs in `--queues` queues of one cohort;
- `steady`: `--waiting` jobs waiting for quota in the same cohort, then arrivals at `--rate`/s for `--seconds`,
  each running `--duration` s, so that jobs complete while others arrive;
- `scale`: start-up on `--nodes` (say 20,000) nodes, then a burst; reports how long the scheduler took to learn
  every node.

Unless attached, the stack runs in a fresh platform namespace (`bench-…`, streams marked `gpuq:bench`) and a
scratch database on the servers of NATS_URL / DATABASE_URL (embedded ones when unset), and both are deleted at
the end: nothing it did not create is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress

from shared import gcpolicy
from shared import namespace as namespaces

SERVICES = "admission,scheduler,executor,preemption,metering,telemetry"
# The simulated executor's sampling interval the benchmark runs with by default: dcgm-exporter's default
# collection interval (its --collect-interval flag, 30000 ms), the cadence of real utilisation samples. Earlier
# benchmarks ran with a sample per node a second (`--sample-interval 1`).
DCGM_EXPORTER_INTERVAL_S = 30.0
LONG_S = 86_400  # a burst's jobs run this long: they hold their GPUs for the whole measurement
SUBMIT_CHUNK = 1000  # burst submissions published per batch of acknowledgements


@dataclass
class Watch:
    """Arrival times of JobAdmitted / JobPlaced per job, read off the bus (core NATS subscriptions)."""

    submitted: dict[str, float] = field(default_factory=dict)
    admitted: dict[str, float] = field(default_factory=dict)
    placed: dict[str, float] = field(default_factory=dict)
    # submitted jobs seen placed, counted as they arrive: the driver's wait must not cost O(jobs) per poll (in the
    # one-process layout it shares the CPU with the services it measures)
    placed_submitted: int = 0
    # admission's first verdict on each job: admitted, pending (waits for quota) or rejected, whichever came first
    decided: dict[str, float] = field(default_factory=dict)

    def on(self, kind: dict[str, float] | None) -> Any:
        """A callback recording each job's first event of one kind (None: a JobPending or JobRejected, admission's
        verdict when it is not an admission; the scheduler's later JobPending about an admitted job comes after its
        JobAdmitted, so the first verdict time stays admission's)."""
        async def cb(msg: Any) -> None:
            now = time.perf_counter()
            try:
                job = json.loads(msg.data)["data"]["job_id"]
            except (ValueError, KeyError, TypeError):
                return
            if kind is None or kind is self.admitted:
                self.decided.setdefault(job, now)
            if kind is not None and job not in kind:
                kind[job] = now
                if kind is self.placed and job in self.submitted:
                    self.placed_submitted += 1

        return cb


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _cluster(nodes: int) -> dict[str, Any]:
    return {"node_groups": [{"name": "h100", "count": nodes, "gpus_per_node": 8, "gpu_model": "H100-80GB",
                             "cpu_milli": 192_000, "memory_mib": 2_000_000, "nodes_per_rack": 8}]}


def _queues(queues: int, nodes: int, waiting: int) -> dict[str, Any]:
    per_queue = nodes * 8 // queues
    return {
        "priority_classes": [{"name": "normal", "value": 100}],
        "cohorts": [{"name": "bench"}],
        "queues": [{"name": f"team-{i:02d}", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": per_queue}}}
                   for i in range(queues)]
        # Room for one job and no borrowing: the first waiting job holds it, the others wait for quota in the cohort
        # (every cycle there judges them). With no quota at all they could never be admitted and were rejected at
        # submission (InadmissibleExceedsLimits), so nothing waited: the steady figures before 2026-12 had none.
        + ([{"name": "waiting", "cohort": "bench", "quotas": {"H100-80GB": {"nominal": 1, "borrowing_limit": 0}}}]
           if waiting else []),
    }


def _submission(job_id: str, queue: str, duration_s: float) -> tuple[str, bytes, str]:
    from services.executor.sim import DURATION_LABEL
    from shared.domain import JobSpec, PodSet
    from shared.events import JobSubmitted, encode_event
    from shared.tracing import traced_event

    at = datetime.now(UTC)
    spec = JobSpec(job_id=job_id, team=queue, queue=queue, max_runtime_s=max(LONG_S, int(duration_s) + 60),
                   labels={DURATION_LABEL: str(duration_s)},
                   pod_sets=(PodSet(count=1, gpus_per_pod=1, gpu_models=("H100-80GB",)),))
    event = traced_event(JobSubmitted(spec=spec, submitted_at=at), source="bench", time=at)
    return JobSubmitted(spec=spec).scoped_subject(queue), encode_event(event), event.id


class Meter:
    """CPU seconds and RSS of this process and its children, and CPU seconds of the machine's Postgres processes."""

    def __init__(self, pids: list[int], names: list[str] | None = None) -> None:
        import psutil

        self.psutil = psutil
        self.procs = [psutil.Process(pid) for pid in pids]
        # what each process is called in the report: its service (processes layout), else its pid
        self.names = {str(pid): name for pid, name in zip(pids, names or [str(p) for p in pids], strict=True)}
        self.start = self._read()

    def _postgres(self) -> float:
        """CPU seconds of the live Postgres processes, plus what the ended ones used (a connection's backend exits
        with it: its time is then in its parent's `children_*` times, once the postmaster has reaped it)."""
        total = 0.0
        for proc in self.psutil.process_iter(["name", "ppid"]):
            if proc.info["name"] not in ("postgres", "postmaster"):
                continue
            with contextlib.suppress(self.psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
                parent = self.psutil.Process(proc.info["ppid"])
                if parent.name() not in ("postgres", "postmaster"):  # the postmaster itself
                    total += t.children_user + t.children_system
        return total

    def _read(self) -> dict[str, float]:
        out = {}
        for proc in self.procs:
            with contextlib.suppress(self.psutil.Error):
                t = proc.cpu_times()
                # with the children it reaped: admission's ETA replays run in forked children (shared/forked.py)
                out[str(proc.pid)] = t.user + t.system + t.children_user + t.children_system
        out["postgres"] = self._postgres()
        return out

    def report(self, jobs: int) -> dict[str, Any]:
        end = self._read()
        gpuq = {self.names[pid]: round(end[pid] - self.start.get(pid, 0.0), 2) for pid in end if pid != "postgres"}
        rss = {}
        for proc in self.procs:
            with contextlib.suppress(self.psutil.Error):
                rss[self.names[str(proc.pid)]] = round(proc.memory_info().rss / 2**20, 1)
        pg = end["postgres"] - self.start["postgres"]
        cpu = sum(gpuq.values())
        return {"gpuq_cpu_s": gpuq, "gpuq_rss_mib": rss, "postgres_cpu_s": round(pg, 2),
                "gpuq_cpu_ms_per_job": round(1000 * cpu / max(1, jobs), 2),
                "postgres_cpu_ms_per_job": round(1000 * pg / max(1, jobs), 2)}


def _peak_rss_bytes(pid: int) -> int | None:
    """A process's peak resident set so far (Linux's VmHWM), None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _mib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


# pg_stat_database's counters of the run's own database (active_time and session_time are milliseconds)
_DB_STATS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted", "tup_fetched",
             "blks_read", "blks_hit", "temp_bytes", "active_time", "session_time")


class Footprint:
    """What a run cost, for sizing: each process's CPU seconds since it started and its peak RSS (the services,
    and the NATS server when the run started its own), and the CPU of the Postgres backends serving the run's own
    database. Those backends are listed from pg_stat_activity every `interval` s and their CPU read while they
    live (an ended backend's time goes to the postmaster, with every other database's); the server's background
    processes (checkpointer, WAL writer, autovacuum) serve every database and are not counted."""

    def __init__(self, procs: dict[str, int], pool: Any, *, local_postgres: bool, interval: float = 1.0) -> None:
        import psutil

        self.psutil = psutil
        self.pool, self.local_postgres, self.interval = pool, local_postgres, interval
        self.procs: dict[str, Any] = {}
        for name, pid in procs.items():
            with contextlib.suppress(psutil.Error):
                self.procs[name] = psutil.Process(pid)
        self.cpu: dict[str, float] = {}
        self.rss_peak: dict[str, int] = {}
        self.backend_cpu: dict[tuple[int, Any], float] = {}  # (pid, backend_start) -> CPU seconds last read
        self.backends: dict[tuple[int, Any], Any] = {}
        self.peak_connections = 0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval)

    async def sample(self) -> None:
        for name, proc in self.procs.items():
            with contextlib.suppress(self.psutil.Error):
                t = proc.cpu_times()
                # with the children it reaped: admission's ETA replays run in forked children (shared/forked.py)
                self.cpu[name] = t.user + t.system + t.children_user + t.children_system
                rss = max(proc.memory_info().rss, _peak_rss_bytes(proc.pid) or 0)
                self.rss_peak[name] = max(self.rss_peak.get(name, 0), rss)
        rows = await self.pool.fetch("SELECT pid, backend_start FROM pg_stat_activity "
                                     "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        self.peak_connections = max(self.peak_connections, len(rows))
        if not self.local_postgres:
            return
        for row in rows:
            key = (row["pid"], row["backend_start"])
            with contextlib.suppress(self.psutil.Error):
                proc = self.backends.get(key) or self.psutil.Process(row["pid"])
                if proc.name() not in ("postgres", "postmaster"):  # not this machine's backend: nothing to read
                    continue
                self.backends[key] = proc
                t = proc.cpu_times()
                self.backend_cpu[key] = t.user + t.system

    async def stop(self) -> None:
        """A last sample, taken while the services still run, then no more."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
            await self.sample()

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far of each process and (`postgres-backends`) of the database's backends, as last sampled."""
        return {**self.cpu, "postgres-backends": sum(self.backend_cpu.values())}

    def processes(self) -> dict[str, dict[str, float | None]]:
        return {name: {"cpu_s": round(self.cpu[name], 2) if name in self.cpu else None,
                       "peak_rss_mib": _mib(self.rss_peak.get(name))} for name in self.procs}

    def postgres(self) -> dict[str, Any]:
        return {"backends_cpu_s": round(sum(self.backend_cpu.values()), 2) if self.local_postgres else None,
                "backends_seen": len(self.backend_cpu) if self.local_postgres else None,
                "peak_connections": self.peak_connections}


def _loopback(url: str) -> bool:
    """Is the Postgres of this URL on this machine (its backends' CPU readable here)?"""
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    return host in ("", "localhost", "::1") or host.startswith("127.") or host.startswith("/")


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _database_figures(db_url: str, start_bytes: int, settle_s: float = 10.0) -> dict[str, Any]:
    """The run's own database once its services stopped: size and growth, rows and bytes per table (and per schema),
    and pg_stat_database's counters. Read once the services' backends are gone: a backend reports its session's
    statistics as it exits."""
    import asyncpg

    conn = await asyncpg.connect(db_url)
    try:
        deadline = time.perf_counter() + settle_s
        while (await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND pid <> pg_backend_pid()") and time.perf_counter() < deadline):
            await asyncio.sleep(0.2)
        end_bytes = await conn.fetchval("SELECT pg_database_size(current_database())")
        tables = await conn.fetch(
            "SELECT n.nspname AS schema, c.relname AS name, pg_total_relation_size(c.oid) AS bytes "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%' "
            "ORDER BY 1, 2")
        per_table: dict[str, dict[str, int]] = {}
        schemas: dict[str, dict[str, int]] = {}
        for t in tables:
            rows = await conn.fetchval(f"SELECT count(*) FROM {_quote_ident(t['schema'])}.{_quote_ident(t['name'])}")
            schema = schemas.setdefault(t["schema"], {"rows": 0, "bytes": 0})
            schema["rows"] += rows
            schema["bytes"] += t["bytes"]
            if rows:
                per_table[f"{t['schema']}.{t['name']}"] = {"rows": rows, "bytes": t["bytes"]}
        stats = await conn.fetchrow(f"SELECT {', '.join(_DB_STATS)} FROM pg_stat_database "
                                    "WHERE datname = current_database()")
    finally:
        await conn.close()
    counters = dict(stats) if stats is not None else {}
    for ms in ("active_time", "session_time"):  # milliseconds: in seconds here
        if counters.get(ms) is not None:
            counters[f"{ms}_s"] = round(counters.pop(ms) / 1000, 2)
    return {"database_mib_start": _mib(start_bytes), "database_mib_end": _mib(end_bytes),
            "database_growth_mib": _mib(end_bytes - start_bytes),
            "rows": sum(s["rows"] for s in schemas.values()),
            "schemas": {name: {"rows": v["rows"], "mib": _mib(v["bytes"])} for name, v in schemas.items()},
            "tables": {name: {"rows": v["rows"], "mib": _mib(v["bytes"])}
                       for name, v in sorted(per_table.items(), key=lambda kv: -kv[1]["bytes"])},
            "stat_database": counters}


async def _stream_messages(js: Any, name: str) -> int:
    from nats.js.errors import NotFoundError

    try:
        return int((await js.stream_info(name)).state.messages)
    except NotFoundError:
        return 0


async def _hold(footprint: Footprint, js: Any, ns: str, seconds: float) -> dict[str, Any]:
    """The steady load once the jobs are placed and every job event handled: the stack left running for `seconds`
    with its jobs running, each busy node sending utilisation samples (the simulated executor's, every
    `--sample-interval` s). The CPU each process used meanwhile, in cores (CPU seconds per second): what a cluster
    full of running jobs costs between arrivals."""
    from shared.bus import streams

    utilization = next(s.name for s in streams(ns) if s.name.endswith("_UTILIZATION"))
    await footprint.sample()
    before, samples_before, t = footprint.cpu_now(), await _stream_messages(js, utilization), time.perf_counter()
    await asyncio.sleep(seconds)
    await footprint.sample()
    after, elapsed = footprint.cpu_now(), time.perf_counter() - t
    cores = {name: round((after[name] - before.get(name, after[name])) / elapsed, 3) for name in after}
    if not footprint.local_postgres:
        cores.pop("postgres-backends")
    return {"seconds": round(elapsed, 1), "cores": cores,
            "services_cores": round(sum(v for k, v in cores.items() if k not in ("nats-server", "postgres-backends")),
                                    3),
            # utilisation events published per second meanwhile (one per busy node per sample interval)
            "utilization_events_per_s": round((await _stream_messages(js, utilization) - samples_before) / elapsed, 1)}


async def _stream_figures(js: Any, ns: str) -> dict[str, Any]:
    """Messages, bytes and consumers of each of the namespace's streams (every stream the run wrote to)."""
    from nats.js.errors import NotFoundError

    from shared.bus import streams

    out: dict[str, dict[str, Any]] = {}
    for stream in streams(ns):
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            continue
        out[stream.name] = {"messages": info.state.messages, "mib": _mib(info.state.bytes),
                            "consumers": info.state.consumer_count}
    return {"messages": sum(s["messages"] for s in out.values()),
            "mib": round(sum(s["mib"] or 0.0 for s in out.values()), 1), "streams": out}


async def _nats_server_figures(monitor_url: str) -> dict[str, Any]:
    """The run's own NATS server from its monitoring endpoint: its memory and CPU now, its traffic, its store."""
    import httpx

    async with httpx.AsyncClient(timeout=5) as client:
        varz = (await client.get(f"{monitor_url}/varz")).json()
        jsz = (await client.get(f"{monitor_url}/jsz")).json()
    return {"version": varz.get("version"), "rss_mib": _mib(varz.get("mem")), "cpu_percent": varz.get("cpu"),
            "in_msgs": varz.get("in_msgs"), "out_msgs": varz.get("out_msgs"),
            "in_mib": _mib(varz.get("in_bytes")), "out_mib": _mib(varz.get("out_bytes")),
            "slow_consumers": varz.get("slow_consumers"),
            "jetstream_store_mib": _mib(jsz.get("storage")), "jetstream_memory_mib": _mib(jsz.get("memory"))}


async def _bus_totals(js: Any, ns: str) -> tuple[int, dict[str, int]]:
    """(messages in the namespace's streams but utilisation samples and dead letters, deliveries to each durable
    consumer: `<service>-<stream subject>`, e.g. `preemption-job`)."""
    from nats.js.errors import NotFoundError

    from shared.bus import streams

    messages = 0
    deliveries: dict[str, int] = {}
    for stream in streams(ns):
        if stream.name.endswith(("_UTILIZATION", "_DLQ", "_AUDIT")):
            continue
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            continue
        messages += info.state.messages
        for consumer in await js.consumers_info(stream.name):
            name = consumer.name or consumer.config.durable_name or "?"
            deliveries[name] = deliveries.get(name, 0) + consumer.delivered.consumer_seq
    return messages, deliveries


async def _job_consumers_settled(js: Any, ns: str,
                                 skip: tuple[str, ...] = ("_UTILIZATION", "_DLQ", "_AUDIT", "_STATUS")) -> bool:
    """Has every consumer of the streams job events travel on (or of every stream but those named `skip`)
    nothing pending and nothing awaiting its ack?"""
    from shared.bus import streams

    for stream in streams(ns):
        if stream.name.endswith(skip):
            continue
        for consumer in await js.consumers_info(stream.name):
            if consumer.num_pending or consumer.num_ack_pending:
                return False
    return True


async def _setup_settled(js: Any, ns: str, pool: Any) -> bool:
    """Has the set-up's work left the pipeline: admission's outbox published and every consumer (status and audit
    included) given and acked everything? Until then the timed part would measure the set-up's spill-over."""
    if await pool.fetchval("SELECT count(*) FROM admission.outbox WHERE published_at IS NULL"):
        return False
    return await _job_consumers_settled(js, ns, skip=("_UTILIZATION", "_DLQ"))


async def _wait(predicate: Any, timeout: float, what: str, progress: Progress | None = None,
                task: Any = None, total: Any = None) -> bool:
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            print(f"bench e2e: timed out after {timeout:.0f} s waiting for {what}", file=sys.stderr)
            return False
        if progress is not None and task is not None and total is not None:
            progress.update(task, completed=total())
        await asyncio.sleep(0.05)
    return True


async def _start_processes(names: list[str], *, nats_url: str, database_url: str, namespace: str,
                           cluster: dict[str, Any], queues: dict[str, Any], timeout: float) -> list[Any]:
    """One `gpuq up --services NAME` process per service (the Helm chart's layout), ready when each answers
    /readyz. The processes' logs stay in a temporary folder, named if they do not become ready."""
    import httpx

    from gpuq_tools.chaos.harness import ServiceProcess
    from shared.servers import free_ports

    workdir = Path(tempfile.mkdtemp(prefix="gpuq-bench-e2e-procs-"))
    cluster_file, queues_file = workdir / "cluster.yaml", workdir / "queues.yaml"
    cluster_file.write_text(json.dumps(cluster))  # JSON is YAML
    queues_file.write_text(json.dumps(queues))
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url, namespaces.ENV: namespace}
    ports = free_ports(2 * len(names))
    procs = [ServiceProcess(name, name, workdir, env, cluster_file, queues_file, (ports[2 * i], ports[2 * i + 1]))
             for i, name in enumerate(names)]
    for proc in procs:
        proc.start()
    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient() as client:
        while not all([await p.ready(client) for p in procs]):
            if time.perf_counter() > deadline or any(p.proc is not None and p.proc.poll() is not None
                                                     for p in procs):
                for p in procs:
                    p.stop()
                raise RuntimeError(f"the services' processes did not become ready; logs in {workdir}")
            await asyncio.sleep(0.2)
    return procs


async def _run(scenario: str, *, nodes: int, queues: int, jobs: int, rate: float, seconds: float, waiting: int,
               duration: float, services: str, attach: bool, timeout: float, progress: Progress,
               layout: str = "one-process", sample_interval: float = DCGM_EXPORTER_INTERVAL_S,
               timeline: Path | None = None, own_nats: bool = False, hold: float = 0.0) -> dict[str, Any]:
    import asyncpg
    import nats

    from services.executor.sim import SAMPLE_INTERVAL_ENV
    from services.stack import Stack, StackSettings
    from shared.bus import ensure_streams
    from shared.config import parse_cluster, parse_queues
    from shared.db import create_pool, scratch_database
    from shared.jetstream import BatchPublisher
    from shared.natsauth import inbox_prefix_for
    from shared.servers import EmbeddedNats, resolve_servers

    own_ns = not attach
    ns = namespaces.current() if attach else namespaces.fresh("bench")
    os.environ[namespaces.ENV] = ns
    if own_ns:  # the simulated executor of the stack started here (in this process or its children) reads it
        os.environ[SAMPLE_INTERVAL_ENV] = repr(sample_interval)
    servers = None if attach else resolve_servers(Path(tempfile.mkdtemp(prefix="gpuq-bench-e2e-")),
                                                  nats_monitor=own_nats)
    # the NATS server this run started (its own: its CPU, memory and traffic are the run's), if any
    own_server = next((s for s in servers.started if isinstance(s, EmbeddedNats)), None) if servers else None
    nats_url = os.environ["NATS_URL"] if attach else servers.nats_url  # type: ignore[union-attr]  # set when not attached
    base_db = os.environ["DATABASE_URL"] if attach else servers.database_url  # type: ignore[union-attr]  # as above
    db_url, db_name = (base_db, "") if attach else await scratch_database(base_db, "gpuq_bench_e2e")
    db_start_bytes = 0
    if db_name:  # the scratch database's size before the services made their schemas: the run's growth is above it
        conn = await asyncpg.connect(db_url)
        try:
            db_start_bytes = await conn.fetchval("SELECT pg_database_size(current_database())")
        finally:
            await conn.close()
    out: dict[str, Any] = {"scenario": scenario, "nodes": nodes, "queues": queues, "services": services,
                           "layout": "attached" if attach else layout,
                           # the background load's cadence (None: an attached stack's own, unknown here)
                           "sample_interval_s": None if attach else sample_interval}
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stack = None
    procs: list[Any] = []
    pids, pid_names = [os.getpid()], ["bench+services" if not attach else "bench"]
    footprint: Footprint | None = None
    measured = False  # the run went to its end: its footprint is worth reading
    try:
        if own_ns:
            await ensure_streams(js, ns, purpose="bench")
            names = [s for s in services.split(",") if s]
            started = time.perf_counter()
            if layout == "processes":
                procs = await _start_processes(names, nats_url=nats_url, database_url=db_url, namespace=ns,
                                               cluster=_cluster(nodes), queues=_queues(queues, nodes, waiting),
                                               timeout=timeout)
                pids = [p.proc.pid for p in procs if p.proc is not None]
                pid_names = [p.service for p in procs if p.proc is not None]
            else:
                settings = StackSettings(nats_url=nats_url, database_url=db_url,
                                         queues=parse_queues(_queues(queues, nodes, waiting)),
                                         cluster=parse_cluster(_cluster(nodes)), services=names)
                stack = Stack(settings)
                await stack.start()
                gcpolicy.install()  # as `gpuq up` does once its services started (shared/gcpolicy.py)
        pool = await create_pool(db_url, max_size=2)
        try:
            if own_ns:
                watched = dict(zip(pid_names, pids, strict=True))
                if own_server is not None and own_server.pid is not None:
                    watched["nats-server"] = own_server.pid
                footprint = Footprint(watched, pool, local_postgres=_loopback(db_url))
                footprint.start()
            if own_ns:
                known = 0

                async def count_nodes() -> None:
                    nonlocal known
                    known = await pool.fetchval("SELECT count(*) FROM scheduler.nodes")

                task = progress.add_task(f"scheduler learns {nodes} nodes", total=nodes)
                deadline = time.perf_counter() + timeout
                while known < nodes and time.perf_counter() < deadline:
                    await count_nodes()
                    progress.update(task, completed=known)
                    await asyncio.sleep(0.2)
                out["startup_s"] = round(time.perf_counter() - started, 2)
                out["nodes_known"] = known
            watch = Watch()
            placed_sub = await nc.subscribe(f"{ns}.job.placed", cb=watch.on(watch.placed))
            # (read until every job has a verdict, after the placements' window)
            verdict_subs = [await nc.subscribe(f"{ns}.job.admitted", cb=watch.on(watch.admitted)),
                            await nc.subscribe(f"{ns}.status.job.pending", cb=watch.on(None)),
                            await nc.subscribe(f"{ns}.job.rejected", cb=watch.on(None))]
            if waiting:
                waiting_from = time.perf_counter()
                task = progress.add_task(f"{waiting} jobs waiting for quota", total=waiting)
                for i in range(waiting):
                    subject, body, event_id = _submission(f"wait-{i:06d}", "waiting", LONG_S)
                    await js.publish_async(subject, body, headers={"Nats-Msg-Id": event_id})
                    progress.advance(task)
                await js.publish_async_completed()
                # settled when admission has judged them all (its jobs table), before the timed part
                while (await pool.fetchval("SELECT count(*) FROM admission.jobs WHERE queue = 'waiting'")
                       or 0) < waiting:
                    await asyncio.sleep(0.5)
                out["waiting_pending"] = await pool.fetchval(
                    "SELECT count(*) FROM admission.jobs WHERE queue = 'waiting' AND status = 'pending'")
                # and once their events (JobQueued, JobPending, audit records: three per job) have been published
                # and read: before 2026-12-02 the timed part began while they were, and its first second's
                # arrivals waited behind them (most of the steady p99)
                settle_deadline = time.perf_counter() + timeout
                while not await _setup_settled(js, ns, pool) and time.perf_counter() < settle_deadline:
                    await asyncio.sleep(0.25)
                out["waiting_settled_s"] = round(time.perf_counter() - waiting_from, 2)
            before_msgs, before_deliveries = await _bus_totals(js, ns)
            meter = Meter(pids, pid_names)
            task = progress.add_task(f"{scenario}: submitting", total=jobs)
            t0 = time.perf_counter()
            if scenario == "steady":
                total = int(rate * seconds)
                interval = 1.0 / rate
                for i in range(total):
                    target = t0 + i * interval
                    delay = target - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    subject, body, event_id = _submission(f"job-{i:06d}", f"team-{i % queues:02d}", duration)
                    watch.submitted[f"job-{i:06d}"] = time.perf_counter()
                    await js.publish_async(subject, body, headers={"Nats-Msg-Id": event_id})
                    progress.advance(task)
                jobs = total
            else:
                # In chunks whose acknowledgements are awaited together (as a producer's batch job would publish):
                # the driver shares this machine's CPU with the platform it measures, so it spends as little as it can.
                publisher = BatchPublisher(nc, inbox_prefix_for(nats_url))
                await publisher.start()
                for first in range(0, jobs, SUBMIT_CHUNK):
                    chunk = []
                    for i in range(first, min(jobs, first + SUBMIT_CHUNK)):
                        subject, body, event_id = _submission(f"job-{i:06d}", f"team-{i % queues:02d}", LONG_S)
                        chunk.append((subject, body, {"Nats-Msg-Id": event_id}))
                        watch.submitted[f"job-{i:06d}"] = time.perf_counter()
                    failed = [r for r in await publisher.publish(chunk, timeout=60) if r is not None]
                    if failed:
                        raise RuntimeError(f"{len(failed)} submissions were refused: {failed[0]}")
                    progress.advance(task, len(chunk))
                await publisher.close()
            await js.publish_async_completed()
            submit_s = time.perf_counter() - t0
            fit = min(jobs, nodes * 8)
            task = progress.add_task(f"{scenario}: placing", total=fit)
            ok = await _wait(lambda: watch.placed_submitted >= fit, timeout, f"{fit} placements", progress, task,
                             lambda: watch.placed_submitted)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            await asyncio.sleep(1.0)  # the events after the placements (JobStarted, metering) settle
            after_msgs, after_deliveries = await _bus_totals(js, ns)
            await placed_sub.unsubscribe()
            jobs_seen = [j for j in watch.submitted if j in watch.placed]
            if timeline is not None:
                _write_timeline(timeline, watch, t0)
            to_admit = [watch.admitted[j] - watch.submitted[j] for j in watch.submitted if j in watch.admitted]
            to_place = [watch.placed[j] - watch.submitted[j] for j in jobs_seen]
            last_admit = max((watch.admitted[j] for j in watch.submitted if j in watch.admitted), default=t0)
            last_place = max((watch.placed[j] for j in jobs_seen), default=t0)
            out.update({
                "jobs": jobs, "waiting": waiting, "completed_in_time": ok, "submit_s": round(submit_s, 2),
                "admitted": len(to_admit), "placed": len(jobs_seen), "elapsed_s": round(elapsed, 2),
                "admissions_per_s": round(len(to_admit) / max(last_admit - t0, 1e-9), 1),
                "placements_per_s": round(len(jobs_seen) / max(last_place - t0, 1e-9), 1),
                "submit_to_admitted_p50_ms": _ms(statistics.median(to_admit) if to_admit else None),
                "submit_to_admitted_p99_ms": _ms(_percentile(to_admit, 0.99)),
                "submit_to_placed_p50_ms": _ms(statistics.median(to_place) if to_place else None),
                "submit_to_placed_p99_ms": _ms(_percentile(to_place, 0.99)),
                "events_per_job": round((after_msgs - before_msgs) / max(1, jobs), 2),
                "deliveries_per_job": round((sum(after_deliveries.values()) - sum(before_deliveries.values()))
                                            / max(1, jobs), 2),
                # per durable consumer: which service receives what (a consumer filtering on a stream's pattern
                # gets every event of it, handled or acked unread)
                "deliveries_per_job_by_consumer": {
                    name: round((n - before_deliveries.get(name, 0)) / max(1, jobs), 2)
                    for name, n in sorted(after_deliveries.items()) if n > before_deliveries.get(name, 0)},
            })
            out.update(meter.report(jobs))
            # The window above ends 1 s after the last placement, when services may still be working through the
            # job events (a saturated one uses all the CPU it gets whatever its cost per event). Per-job CPU is
            # read again once every consumer of the job streams has settled everything it was given.
            drain_deadline = time.perf_counter() + max(60.0, timeout - elapsed)
            while not (drained := await _job_consumers_settled(js, ns)) and time.perf_counter() < drain_deadline:
                await asyncio.sleep(0.25)
            # Admission's verdict on every job (admitted, or pending for quota: a decision too), not only the
            # admissions: once the consumers settled, its last verdicts may still be on their way from its outbox.
            while (sum(1 for j in watch.submitted if j in watch.decided) < len(watch.submitted)
                   and time.perf_counter() < drain_deadline):
                await asyncio.sleep(0.25)
            for sub in verdict_subs:
                await sub.unsubscribe()
            decided = [watch.decided[j] for j in watch.submitted if j in watch.decided]
            out.update({"decided": len(decided),
                        "decisions_per_s": round(len(decided) / max(max(decided, default=t0) - t0, 1e-9), 1)})
            if drained:
                again = meter.report(jobs)
                out.update({"drained_s": round(time.perf_counter() - t0, 2),
                            "gpuq_cpu_ms_per_job_drained": again["gpuq_cpu_ms_per_job"],
                            "postgres_cpu_ms_per_job_drained": again["postgres_cpu_ms_per_job"],
                            "gpuq_cpu_s_drained": again["gpuq_cpu_s"]})
            if hold > 0 and footprint is not None:
                out["hold"] = await _hold(footprint, js, ns, hold)
            measured = True
        finally:
            if footprint is not None:
                await footprint.stop()
            await pool.close()
    finally:
        if stack is not None:
            await stack.stop()
            gcpolicy.uninstall()
        for proc in procs:
            await asyncio.to_thread(proc.stop)
        try:
            if measured and footprint is not None:
                out["sizing"] = await _sizing(footprint, js, ns, db_url, db_start_bytes, own_server)
        finally:
            await _cleanup(js, ns, nc, own_ns=own_ns, base_db=base_db, db_name=db_name, servers=servers)
    return out


async def _sizing(footprint: Footprint, js: Any, ns: str, db_url: str, db_start_bytes: int,
                  own_server: Any) -> dict[str, Any]:
    """The run's footprint for sizing (docs/install.md): processes, its database, its streams, its NATS server."""
    processes = footprint.processes()
    nats_process = processes.pop("nats-server", None)
    server = None
    if own_server is not None and own_server.monitor_url is not None:
        server = {**(await _nats_server_figures(own_server.monitor_url)),
                  "cpu_s": nats_process["cpu_s"] if nats_process else None,
                  "peak_rss_mib": nats_process["peak_rss_mib"] if nats_process else None}
    return {"services": processes,
            "services_cpu_s": round(sum(p["cpu_s"] or 0.0 for p in processes.values()), 2),
            "services_peak_rss_mib": round(sum(p["peak_rss_mib"] or 0.0 for p in processes.values()), 1),
            "postgres": {**(await _database_figures(db_url, db_start_bytes)), **footprint.postgres()},
            # server: None when the run used a server of NATS_URL shared with others (--own-nats starts its own)
            "nats": {**(await _stream_figures(js, ns)), "server": server}}


async def _cleanup(js: Any, ns: str, nc: Any, *, own_ns: bool, base_db: str, db_name: str, servers: Any) -> None:
    from shared.bus import delete_streams
    from shared.db import drop_database

    """Deletes what the run made (its streams, its database, the servers it started), each step even if one before
    it failed."""
    try:
        if own_ns:
            with contextlib.suppress(Exception):
                await delete_streams(js, ns, purpose="bench")
        await nc.close()
    finally:
        try:
            if db_name:
                await drop_database(base_db, db_name)
        finally:
            if servers is not None:
                servers.close()


def _write_timeline(path: Path, watch: Watch, t0: float) -> None:
    """One row per submitted job: seconds from the first submission to its submission, admission and placement
    (empty when it did not happen in time), to see where in a run a tail comes from."""
    def at(times: dict[str, float], job: str) -> str:
        return f"{times[job] - t0:.4f}" if job in times else ""

    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job_id", "submitted_s", "admitted_s", "placed_s"])
        for job in sorted(watch.submitted, key=lambda j: (watch.submitted[j], j)):
            writer.writerow([job, at(watch.submitted, job), at(watch.admitted, job), at(watch.placed, job)])


def bench_e2e(
    scenario: str = typer.Argument("burst", help="burst | steady | scale (see the command's description)"),
    nodes: int = typer.Option(1000, help="Simulated nodes (8 H100 each)."),
    queues: int = typer.Option(20, help="Team queues, in one cohort, sharing the GPUs' quota equally."),
    jobs: int = typer.Option(1000, help="burst/scale: 1-GPU jobs submitted at once."),
    rate: float = typer.Option(100.0, help="steady: arrivals per second."),
    seconds: float = typer.Option(20.0, help="steady: how long arrivals go on."),
    waiting: int = typer.Option(0, help="Jobs left waiting for quota in the same cohort before the timed part "
                                        "(steady: 10,000 in the issue's scenario)."),
    duration: float = typer.Option(5.0, help="steady: seconds each arriving job runs."),
    services: str = typer.Option(SERVICES, help="Services the started stack runs (comma-separated)."),
    layout: str = typer.Option("one-process", help="one-process: every service in this process (`gpuq up`'s "
                               "default); processes: one `gpuq up --services NAME` process per service, as the Helm "
                               "chart runs them (CPU and RSS are then reported per process)."),
    attach: bool = typer.Option(False, "--attach", help="Drive the stack already running on NATS_URL / "
                                "DATABASE_URL in GPUQ_NAMESPACE instead of starting one."),
    timeout: float = typer.Option(600.0, help="Seconds to wait for the placements before reporting what came."),
    sample_interval: float = typer.Option(DCGM_EXPORTER_INTERVAL_S, help="Seconds between the simulated "
                                          "executor's utilisation samples of each busy node (the background "
                                          "load; default: dcgm-exporter's default collection interval; 1 gives "
                                          "the figures of earlier benchmarks). Ignored with --attach.", min=0.001),
    timeline: Path | None = typer.Option(None, help="Also write one CSV row per submitted job (seconds from the "
                                         "first submission to its submission, admission and placement) to this "
                                         "file.", dir_okay=False, writable=True),
    hold: float = typer.Option(0.0, help="Once the jobs are placed and their events handled, leave the stack "
                               "running this many seconds more, its jobs running, and report each process's CPU "
                               "meanwhile in cores (`hold`: the steady load of a full cluster). Ignored with "
                               "--attach.", min=0.0),
    own_nats: bool = typer.Option(False, "--own-nats", help="Start a NATS server of the run's own (the embedded "
                                  "one, with its monitoring endpoint) even when NATS_URL is set, so the report's NATS "
                                  "server figures (CPU, memory, traffic) are the run's alone. Ignored with --attach."),
) -> None:
    """The running platform end to end: placements/s, admissions/s, submit→admitted and submit→placed p50/p99,
    events and deliveries per job, CPU and RSS, Postgres CPU, and the run's footprint for sizing (`sizing`: each
    service's CPU seconds and peak RSS, its database's growth and rows, its streams, its NATS server). Prints one
    JSON object."""
    if scenario not in ("burst", "steady", "scale"):
        raise typer.BadParameter(f"unknown scenario {scenario!r}: burst, steady or scale")
    if layout not in ("one-process", "processes"):
        raise typer.BadParameter(f"unknown layout {layout!r}: one-process or processes")
    if attach and not (os.environ.get("NATS_URL") and os.environ.get("DATABASE_URL")):
        raise typer.BadParameter("--attach needs NATS_URL and DATABASE_URL of the running stack")
    import logging

    logging.basicConfig(level=logging.WARNING)
    with Progress(transient=True, console=Console(file=sys.stderr)) as progress:
        result = asyncio.run(_run(scenario, nodes=nodes, queues=queues, jobs=jobs, rate=rate, seconds=seconds,
                                  waiting=waiting, duration=duration, services=services, attach=attach,
                                  timeout=timeout, progress=progress, layout=layout,
                                  sample_interval=sample_interval, timeline=timeline,
                                  own_nats=own_nats and not attach, hold=0.0 if attach else hold))
    typer.echo(json.dumps(result))
