"""The chaos harness: run the platform as one process per service on a NATS and a Postgres of its own, submit
jobs, kill and restart each service process, NATS and Postgres in turn, pause a service past its lease, then check
the invariants over the whole event history.

Invariants (`check_history`, pure over the recorded history, and the harness's database checks):
- every submitted job ends in exactly one terminal state (one terminal event id per job; admission agrees);
- no GPU is ever held by two jobs at once, over the whole placement history (stream order: a GPU is held from a
  job's JobPlaced to its next terminal or preemption event);
- quota use never exceeds what admission may grant (per queue, admitted GPUs ≤ nominal quota at every step), and
  only admitted jobs are placed;
- the metering ledger's allocated GPU-seconds equal the executor's (its JobStarted → terminal times × GPUs) within
  one sampling interval per job;
- no job is stuck (all terminal before the deadline);
- no dead letters but the ones the harness injected.

Recovery time of a fault: from its injection (for a pause: from the resume) until every process is ready again and
a job event newer than the fault is on the bus (work moves again). Wall-clock figures are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
from nats.js.errors import NotFoundError

from shared.bus import ensure_streams, streams
from shared.events import BY_TYPE, JobSubmitted, make_event
from shared.servers import EmbeddedNats, ScratchPostgres, free_ports
from shared.service import publish_event

log = logging.getLogger("gpuq.chaos")

TERMINAL = ("io.gpuq.job.completed.v1", "io.gpuq.job.failed.v1", "io.gpuq.job.cancelled.v1")
RELEASE = (*TERMINAL, "io.gpuq.job.preempted.v1")
SERVICES = ("admission", "scheduler", "preemption", "executor", "metering")
STANDBYS = ("scheduler", "executor")  # a second process of these, waiting for the lease
FAULTS = ("kill:admission", "kill:scheduler", "kill:preemption", "kill:executor", "kill:metering", "restart:nats",
          "restart:postgres", "pause:scheduler")
QUEUES = ("team-a", "team-b", "team-c", "team-d")


@dataclass(frozen=True)
class ChaosSettings:
    jobs: int = 200
    nodes: int = 8
    gpus_per_node: int = 8
    min_duration_s: float = 2.0
    max_duration_s: float = 12.0
    max_gpus: int = 2
    arrival_window_s: float = 120.0  # submissions spread over this long: the faults happen while jobs arrive
    faults: tuple[str, ...] = FAULTS
    lease_ttl_s: float = 6.0  # GPUQ_LEASE_TTL_S of the services: the pause lasts longer than this
    pause_extra_s: float = 4.0
    settle_s: float = 3.0  # after a recovery, before the next fault
    deadline_s: float = 240.0  # everything terminal by then, or the jobs left are stuck
    sample_every_s: float = 1.0  # the executor's sampling interval: the ledger tolerance
    poison_events: int = 3
    seed: int = 17

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}: choose among {', '.join(FAULTS)}")
        if self.jobs < 1 or self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("jobs, nodes and gpus_per_node must be at least 1")
        if not 1 <= self.max_gpus <= self.gpus_per_node:
            raise ValueError(f"max_gpus must be between 1 and gpus_per_node ({self.gpus_per_node})")
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("durations: 0 < min_duration_s <= max_duration_s")
        if self.lease_ttl_s < 5:
            raise ValueError("lease_ttl_s must be at least 5 s")


@dataclass
class FaultResult:
    fault: str
    recovery_s: float | None  # None: did not recover within the deadline
    process: str = ""  # the process hit (for a singleton: the one holding the lease then)
    # A pause, or a kill of a singleton with a standby: from the fault until the standby led (None: none did)
    takeover_s: float | None = None


@dataclass
class ChaosReport:
    submitted: int = 0
    terminal: int = 0
    faults: list[FaultResult] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    events: int = 0
    dead_letters: int = 0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations and all(f.recovery_s is not None for f in self.faults)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "submitted": self.submitted, "terminal": self.terminal, "events": self.events,
                "dead_letters": self.dead_letters, "wall_s": round(self.wall_s, 1),
                "faults": [{"fault": f.fault, "process": f.process,
                            "recovery_s": round(f.recovery_s, 2) if f.recovery_s is not None else None,
                            "takeover_s": round(f.takeover_s, 2) if f.takeover_s is not None else None}
                           for f in self.faults],
                "violations": self.violations}


# --------------------------------------------------------------------------- the invariants (pure)


@dataclass(frozen=True)
class Recorded:
    """One event of the JOBS stream, in stream order."""

    seq: int
    type: str
    id: str
    data: dict[str, Any]


def check_history(history: Iterable[Recorded], *, submitted: dict[str, tuple[str, int]],
                  quotas: dict[str, int]) -> list[str]:
    """Violations of the event-history invariants. `submitted`: job → (queue, GPUs); `quotas`: queue → GPUs."""
    violations: list[str] = []
    terminal_ids: dict[str, set[str]] = defaultdict(set)
    holder: dict[tuple[str, int], str] = {}  # (node, gpu) -> job holding it
    held_by: dict[str, list[tuple[str, int]]] = {}
    admitted: dict[str, str] = {}  # job -> queue, while admitted
    usage: dict[str, int] = defaultdict(int)
    for event in sorted(history, key=lambda e: e.seq):
        job = str(event.data.get("job_id") or event.data.get("spec", {}).get("job_id") or "")
        if event.type == "io.gpuq.job.admitted.v1" and job not in admitted:
            queue, gpus = submitted.get(job, (str(event.data["spec"]["queue"]), 0))
            admitted[job] = queue
            usage[queue] += gpus
            if usage[queue] > quotas.get(queue, 0):
                violations.append(f"seq {event.seq}: queue {queue} uses {usage[queue]} GPUs, quota "
                                  f"{quotas.get(queue, 0)} (admitting {job})")
        elif event.type == "io.gpuq.job.placed.v1":
            if job not in admitted:
                violations.append(f"seq {event.seq}: {job} placed without being admitted")
            devices = [(b["node"], g) for b in event.data["bindings"] for g in b.get("gpu_indices", ())]
            for gpu in devices:
                other = holder.get(gpu)
                if other is not None and other != job:
                    violations.append(f"seq {event.seq}: GPU {gpu[0]}/{gpu[1]} given to {job} while {other} holds it")
                holder[gpu] = job
            held_by[job] = devices
        elif event.type in RELEASE:
            for gpu in held_by.pop(job, []):
                if holder.get(gpu) == job:
                    del holder[gpu]
            queue_of = admitted.pop(job, None)
            if queue_of is not None:
                usage[queue_of] -= submitted.get(job, (queue_of, 0))[1]
            if event.type in TERMINAL:
                terminal_ids[job].add(event.id)
    for job in sorted(submitted):
        ids = terminal_ids.get(job, set())
        if len(ids) != 1:
            violations.append(f"{job}: {len(ids)} terminal events (expected exactly one)")
    return violations


def executor_gpu_seconds(history: Iterable[Recorded], gpus: dict[str, int]) -> dict[str, float]:
    """Per job, the GPU-seconds the executor reported: its JobStarted → terminal times, times the job's GPUs."""
    started: dict[str, datetime] = {}
    out: dict[str, float] = defaultdict(float)
    for event in sorted(history, key=lambda e: e.seq):
        job = str(event.data.get("job_id", ""))
        if event.type == "io.gpuq.job.started.v1":
            started[job] = datetime.fromisoformat(event.data["started_at"])
        elif event.type in RELEASE and job in started:
            end = event.data.get("finished_at") or event.data.get("preempted_at") or event.data.get("cancelled_at")
            if end is not None:
                out[job] += (datetime.fromisoformat(end) - started.pop(job)).total_seconds() * gpus.get(job, 0)
    return dict(out)


# --------------------------------------------------------------------------- processes


class ServiceProcess:
    """One `gpuq up --services NAME` process, restarted on the same health and metrics ports (picked once for the
    whole run with every other port of it: a port picked while a killed service is down could be that service's)."""

    def __init__(self, name: str, service: str, workdir: Path, env: dict[str, str], cluster: Path, queues: Path,
                 ports: tuple[int, int]):
        self.name, self.service = name, service
        self.workdir, self.env, self.cluster, self.queues = workdir, env, cluster, queues
        self.port, self.metrics_port = ports
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        home = self.workdir / "homes" / self.name
        home.mkdir(parents=True, exist_ok=True)
        log_file = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115  # the child keeps it open
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from cli.main import app; app()", "up", "--services", self.service,
             "--cluster", str(self.cluster), "--queues", str(self.queues), "--health-port", str(self.port),
             "--health-addr", "127.0.0.1", "--instance", f"{self.name}-{self.starts}", "--log-level", "WARNING",
             "--metrics-port", str(self.metrics_port)],
            # its own config file: `gpuq up` records its state directory there, never in the user's (or a test
            # session's) config, which every service process writing at once would also race on
            cwd=home, env={**self.env, "GPUQ_HOME": str(home), "GPUQ_CONFIG": str(home / "config.yaml")},
            stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
        log_file.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    async def ready(self, client: httpx.AsyncClient) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            response = await client.get(f"http://127.0.0.1:{self.port}/readyz", timeout=3)
        except httpx.HTTPError:
            return False
        return response.status_code == 200


# --------------------------------------------------------------------------- the run


def _files(workdir: Path, settings: ChaosSettings) -> tuple[Path, Path, dict[str, int]]:
    total = settings.nodes * settings.gpus_per_node
    share = max(settings.max_gpus, total // len(QUEUES))
    quotas = {q: share for q in QUEUES}
    cluster = workdir / "cluster.yaml"
    cluster.write_text(json.dumps({"node_groups": [
        {"name": "h100", "count": settings.nodes, "gpus_per_node": settings.gpus_per_node, "gpu_model": "H100-80GB",
         "cpu_milli": 96000, "memory_mib": 1048576}]}))
    queues = workdir / "queues.yaml"
    queues.write_text(json.dumps({
        "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
        "queues": [{"name": q, "teams": [q], "quotas": {"H100-80GB": {"nominal": share}}} for q in QUEUES]}))
    return cluster, queues, quotas


def _jobs(settings: ChaosSettings) -> list[dict[str, Any]]:
    rng = random.Random(settings.seed)  # the workload only: decisions stay the services'
    out = []
    for i in range(settings.jobs):
        queue = QUEUES[i % len(QUEUES)]
        duration = round(rng.uniform(settings.min_duration_s, settings.max_duration_s), 1)
        out.append({"job_id": f"chaos-{i:05d}", "team": queue, "queue": queue,
                    "pod_sets": [{"count": 1, "gpus_per_pod": rng.randint(1, settings.max_gpus)}],
                    "max_runtime_s": int(duration * 20 + 600), "labels": {"sim.gpuq.io/duration-s": str(duration)}})
    return out


class Harness:
    def __init__(self, settings: ChaosSettings, workdir: Path, namespace: str,
                 say: Callable[[str], None] = print):
        self.settings, self.workdir, self.namespace, self.say = settings, workdir, namespace, say
        # Every port of the run, distinct, picked before anything listens: NATS, Postgres, then each service
        # process's health and metrics ports (`_run`). Each keeps its port across its restarts.
        nats_port, pg_port, *self._service_ports = free_ports(2 + 2 * (len(SERVICES) + len(STANDBYS)))
        self.nats = EmbeddedNats(workdir / "nats", port=nats_port)
        self.pg = ScratchPostgres(workdir / "pg", port=pg_port)
        self.procs: dict[str, ServiceProcess] = {}
        self.report = ChaosReport()
        self.jobs_stream = next(s.name for s in streams(namespace) if any(".job." in p for p in s.subjects))
        self.poison: list[bytes] = []
        self.submission_done = False
        self.database_url = ""

    async def run(self) -> ChaosReport:
        started = time.monotonic()
        try:
            await self._run()
        finally:
            for proc in self.procs.values():
                await asyncio.to_thread(proc.stop)
            await asyncio.to_thread(self.nats.stop)
            await asyncio.to_thread(self.pg.stop, "fast")
            self.report.wall_s = time.monotonic() - started
        return self.report

    async def _run(self) -> None:
        s = self.settings
        nats_url = await asyncio.to_thread(self.nats.start)
        database_url = self.database_url = await asyncio.to_thread(self.pg.start)
        cluster, queues, quotas = _files(self.workdir, s)
        env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url, "GPUQ_NAMESPACE": self.namespace,
               "GPUQ_LEASE_TTL_S": str(s.lease_ttl_s), "GPUQ_HEARTBEAT_INTERVAL_S": "1"}
        ports = iter(zip(self._service_ports[::2], self._service_ports[1::2], strict=True))
        for service in SERVICES:
            self.procs[service] = ServiceProcess(service, service, self.workdir, env, cluster, queues, next(ports))
        # Standbys: the pause of the active scheduler hands the lease to its standby, and the fence must hold; the
        # kill of the leading executor hands it to the executor's standby, which takes its running jobs over.
        for service in STANDBYS:
            self.procs[f"{service}-standby"] = ServiceProcess(f"{service}-standby", service, self.workdir, env,
                                                              cluster, queues, next(ports))
        async def quiet(exc: Exception) -> None:  # NATS restarts on purpose here: reconnecting is expected
            log.debug("NATS client: %s", exc)

        nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=quiet)
        try:
            await ensure_streams(nc.jetstream(), self.namespace)
            for proc in self.procs.values():
                proc.start()
            async with httpx.AsyncClient() as client:
                if not await self._until_ready(client, 120):
                    raise RuntimeError(f"the services did not become ready; logs in {self.workdir}")
                self.say(f"chaos: {len(self.procs)} processes ready; submitting {s.jobs} jobs over "
                         f"{s.arrival_window_s:g} s")
                jobs = _jobs(s)
                submitted = {j["job_id"]: (j["queue"], j["pod_sets"][0]["gpus_per_pod"]) for j in jobs}
                submitting = asyncio.create_task(self._submit(nc, jobs))
                for fault in s.faults:
                    await asyncio.sleep(s.settle_s)
                    result = await self._inject(fault, client, nc)
                    self.report.faults.append(result)
                    shown = f"{result.recovery_s:.1f} s" if result.recovery_s is not None else "NOT RECOVERED"
                    extra = (f"; the standby led {result.takeover_s:.1f} s after it"
                             if result.takeover_s is not None else "")
                    self.say(f"chaos: {fault:<20} ({result.process}) recovered in {shown}{extra}")
                await submitting
                self.report.submitted = len(jobs)
                await self._until_terminal(database_url, set(submitted))
            await self._check(nc, database_url, submitted, quotas)
        finally:
            await nc.close()

    async def _until_ready(self, client: httpx.AsyncClient, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = await asyncio.gather(*(p.ready(client) for p in self.procs.values()))
            if all(states):
                return True
            await asyncio.sleep(0.2)
        return False

    async def _submit(self, nc: Any, jobs: list[dict[str, Any]]) -> None:
        js = nc.jetstream()
        gap = self.settings.arrival_window_s / max(1, len(jobs))
        poison_at = {int(len(jobs) * (k + 1) / (self.settings.poison_events + 1))
                     for k in range(self.settings.poison_events)}
        for i, job in enumerate(jobs):
            if i in poison_at:  # malformed on purpose: the only dead letters allowed
                body = f"not an event #{i}".encode()
                self.poison.append(body)
                await self._retrying(js.publish, f"{self.namespace}.job.submitted.team-a", body,
                                     headers={"Nats-Msg-Id": f"poison-{i}"}, timeout=5)
            event = make_event(JobSubmitted.model_validate({"spec": job, "submitted_at": datetime.now(UTC)}),
                               source="gpuq/chaos", time=datetime.now(UTC))
            await self._retrying(publish_event, js, event, f"{self.namespace}.job.submitted.{job['team']}")
            await asyncio.sleep(gap)
        self.submission_done = True

    async def _retrying(self, publish: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> None:
        """Publish as a producer does while NATS restarts: retry with the same message id (deduplicated)."""
        for attempt in range(120):
            try:
                await publish(*args, **kwargs)
                return
            except Exception as exc:
                if attempt == 119:
                    raise
                log.info("publish failed (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def _last_seq(self, nc: Any) -> int:
        for _ in range(100):
            try:
                info = await nc.jetstream().stream_info(self.jobs_stream)
                return int(info.state.last_seq)
            except Exception:
                await asyncio.sleep(0.3)
        raise RuntimeError("NATS did not come back")

    async def _inject(self, fault: str, client: httpx.AsyncClient, nc: Any) -> FaultResult:
        kind, _, target = fault.partition(":")
        before = await self._last_seq(nc)
        t0 = time.monotonic()
        hit = target
        takeover: float | None = None
        if kind == "kill":
            proc = await self._active(target, client)
            hit = proc.name
            await asyncio.to_thread(proc.kill)
            proc.start()
            if any(p.service == target and p is not proc for p in self.procs.values()):  # a standby: it leads now
                takeover = await self._takeover(target, proc, client, time.monotonic() + self.settings.deadline_s)
        elif kind == "restart" and target == "nats":
            await asyncio.to_thread(self.nats.stop)
            await asyncio.to_thread(self.nats.start)
        elif kind == "restart" and target == "postgres":
            await asyncio.to_thread(self.pg.stop, "immediate")  # as a crash: recovery replays the WAL
            await asyncio.to_thread(self.pg.start)
        elif kind == "pause":
            proc = await self._active(target, client)
            hit = proc.name
            proc.signal(signal.SIGSTOP)
            paused_until = t0 + self.settings.lease_ttl_s + self.settings.pause_extra_s
            takeover = await self._takeover(target, proc, client, paused_until)
            await asyncio.sleep(max(0.0, paused_until - time.monotonic()))
            proc.signal(signal.SIGCONT)
            t0 = time.monotonic()  # its recovery counts from the resume (the pause itself is the fault's length)
        deadline = time.monotonic() + self.settings.deadline_s
        while time.monotonic() < deadline:
            # Recovered: every process ready, and work moves (a job event newer than the fault), or there is no
            # work left to move (everything submitted so far is terminal).
            if await self._until_ready(client, 1.0) and (await self._last_seq(nc) > before or await self._idle()):
                return FaultResult(fault, time.monotonic() - t0, hit, takeover)
            await asyncio.sleep(0.2)
        return FaultResult(fault, None, hit, takeover)

    async def _idle(self) -> bool:
        if not self.submission_done:
            return False
        try:
            conn = await asyncpg.connect(self.database_url, timeout=5)
        except (OSError, asyncpg.PostgresError):
            return False
        try:
            done = await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE status IN ('finished', 'rejected')")
        except asyncpg.PostgresError:
            return False
        finally:
            await conn.close()
        return bool(done >= self.settings.jobs)

    async def _takeover(self, service: str, paused: ServiceProcess, client: httpx.AsyncClient,
                        until: float) -> float | None:
        """Seconds from now until another process of `service` leads (its phase is running), if before `until`."""
        t0 = time.monotonic()
        others = [p for _, p in sorted(self.procs.items()) if p.service == service and p is not paused]
        while others and time.monotonic() < until:
            for proc in others:
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    body = (await client.get(f"http://127.0.0.1:{proc.port}/readyz", timeout=2)).json()
                    if body["services"][service]["phase"] == "running":
                        return time.monotonic() - t0
            await asyncio.sleep(0.2)
        return None

    async def _active(self, service: str, client: httpx.AsyncClient) -> ServiceProcess:
        """The process running `service` that holds its lease (a singleton's standby is not the one to hit)."""
        candidates = [p for _, p in sorted(self.procs.items()) if p.service == service]
        for proc in candidates:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                body = (await client.get(f"http://127.0.0.1:{proc.port}/readyz", timeout=3)).json()
                if body["services"][service]["phase"] == "running":
                    return proc
        return candidates[0]

    async def _until_terminal(self, database_url: str, jobs: set[str]) -> None:
        deadline = time.monotonic() + self.settings.deadline_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, asyncpg.PostgresError):
                conn = await asyncpg.connect(database_url)
                try:
                    done = await conn.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id = ANY($1::text[]) "
                                               "AND status IN ('finished', 'rejected')", sorted(jobs))
                finally:
                    await conn.close()
                self.report.terminal = int(done)
                if done == len(jobs):
                    return
            await asyncio.sleep(0.5)

    async def _history(self, nc: Any) -> list[Recorded]:
        js = nc.jetstream()
        last = await self._last_seq(nc)
        out: list[Recorded] = []
        for seq in range(1, last + 1):
            try:
                msg = await js.get_msg(self.jobs_stream, seq=seq)
            except NotFoundError:
                continue
            try:
                body = json.loads(msg.data or b"")
            except ValueError:
                continue  # an injected poison message
            if isinstance(body, dict) and body.get("type") in BY_TYPE:
                out.append(Recorded(seq=seq, type=str(body["type"]), id=str(body["id"]), data=body.get("data", {})))
        return out

    async def _check(self, nc: Any, database_url: str, submitted: dict[str, tuple[str, int]],
                     quotas: dict[str, int]) -> None:
        history = await self._history(nc)
        self.report.events = len(history)
        violations = check_history(history, submitted=submitted, quotas=quotas)
        if self.report.terminal != len(submitted):
            violations.append(f"stuck: {len(submitted) - self.report.terminal} of {len(submitted)} jobs not "
                              f"terminal after {self.settings.deadline_s:g} s")
        conn = await asyncpg.connect(database_url)
        try:
            letters = []
            for schema in ("admission", "scheduler", "preemption", "executor", "metering"):
                rows = await conn.fetch(f"SELECT reason, body FROM {schema}.dead_letters ORDER BY id")
                letters += [(schema, r["reason"], bytes(r["body"])) for r in rows]
            self.report.dead_letters = len(letters)
            for schema, reason, body in letters:
                if body not in self.poison:
                    violations.append(f"dead letter in {schema} that was not injected: {reason}: {body[:200]!r}")
            dead_in_admission = {body for schema, _, body in letters if schema == "admission"}
            for body in self.poison:
                if body not in dead_in_admission:
                    violations.append(f"injected poison {body!r} was not dead-lettered by admission")
            ledger = {r["job_id"]: float(r["gpu_s"]) for r in await conn.fetch(
                "SELECT job_id, sum(extract(epoch FROM ended_at - started_at) * milli_gpus / 1000.0) AS gpu_s "
                "FROM metering.allocations WHERE started_at IS NOT NULL AND ended_at IS NOT NULL GROUP BY job_id")}
        finally:
            await conn.close()
        gpus = {job: g for job, (_, g) in submitted.items()}
        reported = executor_gpu_seconds(history, gpus)
        for job in sorted(reported):
            tolerance = self.settings.sample_every_s * gpus.get(job, 1)
            if abs(ledger.get(job, 0.0) - reported[job]) > tolerance:
                violations.append(f"{job}: ledger {ledger.get(job, 0.0):.1f} GPU-s, executor {reported[job]:.1f} "
                                  f"(tolerance {tolerance:g})")
        self.report.violations = violations


async def run_chaos(settings: ChaosSettings, workdir: Path, namespace: str = "chaos",
                    say: Callable[[str], None] = print) -> ChaosReport:
    """Start servers and services under `workdir`, inject the faults, check the invariants. Only what this run
    started is stopped; `workdir` (logs, data) is left to the caller."""
    return await Harness(settings, workdir, namespace, say).run()
