"""`executor/sim`: the embedded simulated cluster built from `cluster.yaml`.

It announces its nodes (NodeInventory), runs each placed job for its duration on the services' clock
(the demo speeds that clock up, so a job runs for its duration divided by the speed-up factor), emits
JobStarted, UtilizationSampled (one batch per node) and JobCompleted/JobFailed, and honours checkpoint
requests after a configurable delay.

The true duration of a simulated job comes from the label `sim.gpuq.io/duration-s` that workload
generators set; only this executor reads it (the scheduler plans with `max_runtime_s`). Optional labels:
`sim.gpuq.io/utilization` (mean GPU utilisation %), `sim.gpuq.io/outcome` (e.g. OOMKilled),
`sim.gpuq.io/failed-attempts` (the outcome applies to the first N attempts only: the job's retry policy then
retries it, see services/executor/attempts.py).

With `dcgm` settings (cluster.yaml or GPUQ_DCGM_PROMETHEUS_URL), the synthetic samples stop and the DCGM source
(services/executor/dcgm.py) reads real ones; this executor then names its jobs' pods and GPUs the way a
Kubernetes cluster with dcgm-exporter would: pod `<job>-<pod set>-<index>` in namespace `<team>`, GPU UUIDs
derived from node and index (`sim_gpu_uuid`), and a MIG slice's index as its GPU instance id.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from services.core.executor.attribution import Placements, units_by_node
from services.core.executor.dcgm_series import Device
from services.executor import fence
from services.executor.attempts import report_failure
from services.executor.dcgm import DcgmSource, degraded_nodes, ensure_health_table, with_health
from services.executor.heartbeat import Heartbeat
from services.executor.verify import SchedulerTables, placement_prefetch, placement_prefetched, verify_placement
from shared.config import ClusterConfig, DcgmSettings
from shared.domain import GpuBinding, JobSpec, NodeSpec
from shared.events import (
    CheckpointRequested,
    CloudEvent,
    ExitReason,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobStarted,
    NodeInventory,
    Payload,
    UtilizationSampled,
    utcnow_from,
)
from shared.service import Handler, ServiceRuntime, ServiceSpec, Tx
from shared.settings import settings

DURATION_LABEL = "sim.gpuq.io/duration-s"
UTILIZATION_LABEL = "sim.gpuq.io/utilization"
OUTCOME_LABEL = "sim.gpuq.io/outcome"
# Fault injection: a job whose pods never report. The simulated executor runs it but neither lists it in its
# heartbeats nor ever finishes it, as when a node's agent dies silently; the scheduler's liveness watch must find it.
SILENT_LABEL = "sim.gpuq.io/silent"
# Fault injection for retries: the outcome label applies to the first N attempts only (default: every attempt), so
# that a job can fail, be retried by its retry policy, and then succeed.
FAILED_ATTEMPTS_LABEL = "sim.gpuq.io/failed-attempts"
MIGRATIONS = Path(__file__).parent / "migrations"

# A consumed batch's new runs, held in its scratch (job id -> row) and written in one round trip at its end, or first
# by any handler of the batch that reads or writes executor.runs: only where any failure rolls the whole batch back,
# so that a crash before the commit loses them with the batch's inbox rows (docs/executor.md, "Batch-end writes").
RUNS_KEY = "executor-held-runs"
_RUN_UPSERT = """INSERT INTO executor.runs(job_id, spec, nodes, gpus, status, started_at, ends_at, done_s, traceparent,
                                       bindings)
    VALUES ($1, $2, $3, $4, 'running', $5, $6, $7, $8, $9::jsonb)
    ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, nodes = excluded.nodes, gpus = excluded.gpus,
      status = 'running', outcome = NULL, started_at = excluded.started_at, ends_at = excluded.ends_at,
      done_s = excluded.done_s, attempt = executor.runs.attempt + 1, traceparent = excluded.traceparent,
      bindings = excluded.bindings"""


async def _write_runs(tx: Tx) -> None:
    held = tx.scratch.pop(RUNS_KEY, None)
    if held:
        await tx.conn.executemany(_RUN_UPSERT, list(held.values()))


@dataclass
class SimExecutorSettings:
    cluster: ClusterConfig
    cluster_dir: Path | None = None
    tick_s: float = 0.1  # wall seconds between completion checks
    # Wall seconds between utilisation batches (None: GPUQ_SIM_SAMPLE_INTERVAL_S, else 1). Real samples come
    # from DCGM every several seconds (dcgm-exporter collects every 30 s by default); `gpuq bench e2e` runs with that.
    sample_every_s: float | None = None
    checkpoint_delay_s: float = 30.0  # virtual seconds a job takes to write a checkpoint
    dcgm: DcgmSettings | None = None  # real samples from dcgm-exporter via Prometheus instead of synthetic ones
    heartbeat_every_s: float | None = None  # wall seconds between heartbeats (None: GPUQ_HEARTBEAT_INTERVAL_S, 10)
    # One acting instance behind the executor's lease, a second one a hot standby (services/executor/fence.py): what
    # `gpuq up` runs. Off for a runtime driven alone (benchmarks, tests of the executor's handlers).
    lease: bool = False


SAMPLE_INTERVAL_ENV = "GPUQ_SIM_SAMPLE_INTERVAL_S"


def sample_interval_from_env() -> float:
    """The simulated executor's sampling interval in seconds: GPUQ_SIM_SAMPLE_INTERVAL_S, else 1."""
    return settings().sim_sample_interval_s


def true_duration(spec: JobSpec) -> float:
    raw = spec.labels.get(DURATION_LABEL)
    return float(raw) if raw is not None else float(spec.max_runtime_s)


def _failed_attempts(spec: JobSpec) -> int:
    """How many attempts the outcome label fails (FAILED_ATTEMPTS_LABEL; every attempt without it)."""
    raw = spec.labels.get(FAILED_ATTEMPTS_LABEL)
    return int(raw) if raw is not None else 1 << 30


def mean_utilization(spec: JobSpec) -> float:
    return min(100.0, max(0.0, float(spec.labels.get(UTILIZATION_LABEL, "70"))))


def jitter(job_id: str, gpu: int, t: float) -> float:
    """Deterministic ±10 points of noise so samples look alive without a random generator."""
    digest = hashlib.blake2b(f"{job_id}/{gpu}/{int(t)}".encode(), digest_size=2).digest()
    return (int.from_bytes(digest, "big") / 65535.0 - 0.5) * 20.0


def sim_pod_name(job_id: str, pod: str) -> str:
    """The pod name a workload controller would give a simulated job's pod (a DNS-1123 label)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{job_id}-{pod}".lower()).strip("-")
    return name[:63].rstrip("-") or "pod"


def sim_gpu_uuid(node: str, gpu: int) -> str:
    """A stable, unique UUID for a simulated GPU, in DCGM's `GPU-<uuid>` form."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'gpuq-sim/{node}/{gpu}')}"


def sim_placements(runs: list[tuple[JobSpec, list[GpuBinding]]]) -> Placements:
    """What the simulated executor knows of where its jobs run: every pod, GPU and MIG slice."""
    pods: dict[tuple[str, str], str] = {}
    devices: dict[Device, str] = {}
    uuids: dict[tuple[str, int | None], str] = {}
    runs = sorted(runs, key=lambda r: r[0].job_id)
    for spec, bindings in runs:
        job = spec.job_id
        for b in bindings:
            pods[(spec.team, sim_pod_name(job, b.pod))] = job
            if b.mig_slice is not None:
                gpu, instance = b.mig_slice
                devices[Device(b.node, gpu, instance)] = job
                uuids[(sim_gpu_uuid(b.node, gpu), instance)] = job
            for gpu in b.gpu_indices:
                devices[Device(b.node, gpu)] = job
                uuids[(sim_gpu_uuid(b.node, gpu), None)] = job
    return Placements(pods=pods, devices=devices, uuids=uuids,
                      nodes=units_by_node((spec.job_id, bindings) for spec, bindings in runs))


class SimExecutor:
    def __init__(self, settings: SimExecutorSettings):
        self.scheduler_tables = SchedulerTables()  # placements are checked against the scheduler's table
        self.settings = settings
        self.nodes = {n.name: n for n in settings.cluster.nodes(settings.cluster_dir)}
        self._models = {name: n.gpu_model for name, n in self.nodes.items()}  # what each node's samples name
        self.sample_every_s = (settings.sample_every_s if settings.sample_every_s is not None
                               else sample_interval_from_env())
        self._last_sample: float | None = None
        self._last_sample_at: float | None = None
        self._sampled_specs: dict[tuple[str, int], tuple[float, int]] = {}  # (job, attempt) -> (util %, GPUs)
        self.dcgm = DcgmSource(settings.dcgm, self) if settings.dcgm is not None else None
        self.heartbeat = Heartbeat("executor/sim", settings.heartbeat_every_s)
        self.runtime: ServiceRuntime | None = None

    def spec(self) -> ServiceSpec:
        background = (self.run_loop,) if self.dcgm is None else (self.run_loop, self.dcgm.run)
        handlers: dict[type[Payload], Handler] = {
            JobPlaced: self.on_placed, CheckpointRequested: self.on_checkpoint_requested,
            JobPreempted: self.on_stopped, JobCancelled: self.on_stopped, JobFailed: self.on_failed}
        return ServiceSpec(
            name="executor", schema="executor", migrations=MIGRATIONS,
            handlers=fence.fenced(handlers, lambda: self.runtime) if self.settings.lease else handlers,
            on_start=self.announce_inventory, background=background, singleton=self.settings.lease,
            optimistic_batches=True,  # its runs are rows; memory holds only settings and sampling times
            prefetch=placement_prefetch(self.scheduler_tables, cancelled_table="executor.cancelled",
                                        runs_table="executor.runs"),
        )

    # ------------------------------------------------------------------ what the DCGM source needs (ExecutorView)

    def node_specs(self) -> Mapping[str, NodeSpec]:
        return self.nodes

    async def placements(self, conn: asyncpg.Connection) -> Placements:
        rows = await conn.fetch("SELECT spec, bindings FROM executor.runs WHERE status = 'running'")
        return sim_placements([(JobSpec.model_validate_json(r["spec"]),
                                [GpuBinding.model_validate(b) for b in json.loads(r["bindings"])]) for r in rows])

    async def node_announced(self, tx: Tx, node: NodeSpec) -> None:
        """Nothing to record: the inventory is announced whole, with the source's verdicts (`with_health`), and
        only when its digest changes."""

    # ------------------------------------------------------------------ inventory

    async def announce_inventory(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        nodes = tuple(sorted(self.nodes.values(), key=lambda n: n.name))
        if self.dcgm is not None:  # nodes the DCGM source degraded stay degraded in a new announcement
            async with runtime.pool.acquire() as conn:
                await ensure_health_table(conn, runtime.spec.schema)
                nodes = tuple(with_health(list(nodes), await degraded_nodes(conn, runtime.spec.schema)))
        digest = hashlib.sha256(json.dumps([n.model_dump(mode="json") for n in nodes]).encode()).hexdigest()
        async with runtime.transaction() as tx:
            last = await tx.conn.fetchval("SELECT value FROM executor.meta WHERE key = 'inventory'")
            if last == digest:
                return
            for part in NodeInventory.chunked(nodes, source="sim", announcement=f"sim-{digest[:16]}"):
                await tx.emit(part)  # one NATS message holds 1 MiB: a big cluster is announced in parts
            await tx.conn.execute(
                "INSERT INTO executor.meta(key, value) VALUES ('inventory', $1) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value", digest)

    # ------------------------------------------------------------------ handlers

    async def on_placed(self, tx: Tx, event: CloudEvent, placed: JobPlaced) -> None:
        # The check and this executor's earlier run of the job in one read (a redelivered placement finds its run);
        # in a consumed batch, one read for all its placements, and the runs written at its end (`_write_runs`).
        if not placement_prefetched(tx.scratch, placed.job_id):
            await _write_runs(tx)  # the check reads this job's run: an earlier message of the batch may hold it
        run = await verify_placement(tx.conn, placed, cancelled_table="executor.cancelled",
                                     tables=self.scheduler_tables, runs_table="executor.runs", scratch=tx.scratch)
        spec = placed.spec
        nodes = sorted({b.node for b in placed.bindings})
        unknown = [n for n in nodes if n not in self.nodes]
        if unknown:
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.NODE_FAILURE,
                                    message=f"placed on nodes this cluster does not have: {', '.join(unknown)}",
                                    finished_at=utcnow_from(tx.now)))
            return
        # GPUs the run holds (a MIG slice counts as one; a pod of a pod set without GPUs holds none, and is never
        # counted as GPU time lost)
        gpus = sum(len(b.gpu_indices) or int(b.mig_slice is not None) for b in placed.bindings)
        if run is not None and run.status == "running":
            return  # the same placement seen twice: nothing to start again
        done_s = run.done_s if run is not None and placed.resume_from else 0.0
        remaining = max(0.0, true_duration(spec) - done_s)
        ends_at = tx.now + min(remaining, float(spec.max_runtime_s))
        bindings = json.dumps([b.model_dump(mode="json") for b in placed.bindings])
        row = (spec.job_id, spec.model_dump_json(), nodes, gpus, tx.now, ends_at, done_s, tx.traceparent, bindings)
        if tx.may_hold_rows:
            held: dict[str, tuple[Any, ...]] = tx.scratch.setdefault(RUNS_KEY, {})
            held[spec.job_id] = row
            await tx.after_events(RUNS_KEY, _write_runs)
        else:
            await tx.conn.executemany(_RUN_UPSERT, [row])
        await tx.emit(JobStarted(job_id=spec.job_id, nodes=tuple(nodes), started_at=utcnow_from(tx.now)))

    async def on_checkpoint_requested(self, tx: Tx, event: CloudEvent, req: CheckpointRequested) -> None:
        await _write_runs(tx)
        row = await tx.conn.fetchrow("SELECT spec FROM executor.runs WHERE job_id = $1 AND status = 'running'",
                                     req.job_id)
        if row is None:
            return
        spec = JobSpec.model_validate_json(row["spec"])
        if not spec.checkpoint.supported:
            return  # the job cannot checkpoint: preemption proceeds after its grace period
        await tx.conn.execute(
            "INSERT INTO executor.checkpoints(job_id, preemption_id, due_at) VALUES ($1, $2, $3) "
            "ON CONFLICT DO NOTHING", req.job_id, req.preemption_id, tx.now + self.settings.checkpoint_delay_s)

    async def on_stopped(self, tx: Tx, event: CloudEvent, payload: JobPreempted | JobCancelled) -> None:
        status = "preempted" if isinstance(payload, JobPreempted) else "cancelled"
        await _write_runs(tx)
        if isinstance(payload, JobCancelled):  # remembered even before the job's placement arrives
            await tx.conn.execute("INSERT INTO executor.cancelled(job_id, at) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                  payload.job_id, tx.now)
        await tx.conn.execute(
            "UPDATE executor.runs SET status = $2, ends_at = $3 WHERE job_id = $1 AND status = 'running'",
            payload.job_id, status, tx.now)

    async def on_failed(self, tx: Tx, event: CloudEvent, payload: JobFailed) -> None:
        """The scheduler declared a job lost: stop running it, so that its GPUs are free here as they are there.
        (Other JobFailed events are this executor's own, coming back: nothing to do.)"""
        if payload.exit_reason is not ExitReason.LOST:
            return
        await _write_runs(tx)
        await tx.conn.execute(
            "UPDATE executor.runs SET status = 'failed', outcome = $2, ends_at = $3 WHERE job_id = $1 "
            "AND status = 'running'", payload.job_id, ExitReason.LOST.value, tx.now)

    # ------------------------------------------------------------------ the running cluster

    async def run_loop(self, runtime: ServiceRuntime) -> None:
        self.heartbeat.bus.forget()  # (re)started: heartbeats wait until the executor is caught up with the bus
        while True:
            await self.step(runtime)
            await asyncio.sleep(self.settings.tick_s)

    async def step(self, runtime: ServiceRuntime) -> None:
        wall = asyncio.get_running_loop().time()
        beat = await self.heartbeat.may_send(runtime, wall)  # only while connected and current
        async with runtime.transaction() as tx:
            await fence.check(tx, runtime)  # a leader replaced while it was not looking ends no run
            await self._finish_due(tx)
            await self._checkpoint_due(tx)
            due = self._last_sample is None or wall - self._last_sample >= self.sample_every_s
            if due and self.dcgm is None:  # with DCGM, real samples replace the synthetic ones
                await self._sample(tx, wall)
            if beat:
                rows = await tx.conn.fetch(
                    "SELECT job_id FROM executor.runs WHERE status = 'running' AND NOT coalesce("
                    f"(spec->'labels'->>'{SILENT_LABEL}')::boolean, false)")
                await self.heartbeat.emit(tx, wall, [r["job_id"] for r in rows])

    async def _finish_due(self, tx: Tx) -> None:
        """End the runs due by now: their events, then every run's new row in one statement (the rows are locked
        by the read, and the events and rows commit together: a crash before the commit ends none of them)."""
        ended: list[tuple[str, str, str | None, int]] = []
        rows = await tx.conn.fetch(
            "SELECT job_id, spec, gpus, started_at, done_s, failures, traceparent FROM executor.runs "
            "WHERE status = 'running' AND ends_at <= $1 "
            f"AND NOT coalesce((spec->'labels'->>'{SILENT_LABEL}')::boolean, false) "
            "ORDER BY ends_at, job_id FOR UPDATE", tx.now)
        for row in rows:
            spec = JobSpec.model_validate_json(row["spec"])
            finished = utcnow_from(tx.now)
            outcome = spec.labels.get(OUTCOME_LABEL)
            ran = tx.now - row["started_at"] + row["done_s"]
            failures = row["failures"]
            failing = outcome is not None and outcome != ExitReason.SUCCEEDED.value \
                and failures < _failed_attempts(spec)
            if failing or ran + 1e-6 < true_duration(spec):
                if outcome is not None and failing:
                    reason = ExitReason(outcome) if outcome in ExitReason.__members__.values() else ExitReason.ERROR
                    message = f"simulated {outcome}"
                else:
                    reason, message = ExitReason.DEADLINE_EXCEEDED, f"ran past max_runtime_s={spec.max_runtime_s}"
                # retried (JobAttemptFailed) or final (JobFailed), per the job's retry policy; counted here
                await report_failure(tx, spec, failures, reason, message,
                                     lost_gpu_seconds=(tx.now - row["started_at"]) * row["gpus"],
                                     traceparent=row["traceparent"])
                status, outcome, failures = "failed", reason.value, failures + 1
            else:
                await tx.emit(JobCompleted(job_id=spec.job_id, finished_at=finished), traceparent=row["traceparent"])
                status, outcome = "completed", ExitReason.SUCCEEDED.value
            ended.append((spec.job_id, status, outcome, failures))
        if ended:
            await tx.conn.execute(
                "UPDATE executor.runs AS r SET status = e.status, outcome = e.outcome, failures = e.failures "
                "FROM unnest($1::text[], $2::text[], $3::text[], $4::integer[]) "
                "AS e(job_id, status, outcome, failures) WHERE r.job_id = e.job_id",
                *(list(column) for column in zip(*ended, strict=True)))

    async def _checkpoint_due(self, tx: Tx) -> None:
        rows = await tx.conn.fetch(
            """SELECT c.job_id, c.preemption_id, c.due_at, r.started_at, r.done_s, r.attempt, r.traceparent
               FROM executor.checkpoints c JOIN executor.runs r USING (job_id)
               WHERE NOT c.done AND c.due_at <= $1 AND r.status = 'running' ORDER BY c.due_at, c.job_id""", tx.now)
        for row in rows:
            progress = row["done_s"] + (row["due_at"] - row["started_at"])
            await tx.conn.execute(
                "UPDATE executor.runs SET done_s = $2, started_at = $3 WHERE job_id = $1",
                row["job_id"], progress, row["due_at"])
            await tx.conn.execute(
                "UPDATE executor.checkpoints SET done = true WHERE job_id = $1 AND preemption_id = $2",
                row["job_id"], row["preemption_id"])
            step = int(progress)
            await tx.emit(JobCheckpointed(
                job_id=row["job_id"], uri=f"sim://checkpoints/{row['job_id']}/attempt-{row['attempt']}/step-{step}",
                step=step, checkpointed_at=utcnow_from(row["due_at"]), preemption_id=row["preemption_id"]),
                traceparent=row["traceparent"])

    async def _sample(self, tx: Tx, wall: float) -> None:
        # The interval is in the services' (possibly accelerated) time, which metering integrates over: the time
        # since the last batch, at least the nominal interval (the first batch covers one nominal interval).
        every = self.sample_every_s
        interval = max(every, tx.now - self._last_sample_at) if self._last_sample_at is not None else every
        self._last_sample, self._last_sample_at = wall, tx.now
        rows = await tx.conn.fetch("SELECT job_id, attempt, nodes FROM executor.runs WHERE status = 'running'")
        # What a sample needs of a run's spec (its mean utilisation, its GPUs), read once per run: a placement
        # (a new attempt) is the only thing that changes a run's spec.
        runs = {(r["job_id"], r["attempt"]) for r in rows}
        missing = sorted(runs - self._sampled_specs.keys())
        if missing:
            for row in await tx.conn.fetch("SELECT job_id, attempt, spec FROM executor.runs WHERE job_id = ANY($1)",
                                           [job_id for job_id, _ in missing]):
                spec = JobSpec.model_validate_json(row["spec"])
                # GPUs sampled: its whole GPUs (a MIG job: one per node, as before; none for a run without GPUs)
                self._sampled_specs[(row["job_id"], row["attempt"])] = (
                    mean_utilization(spec), spec.total_gpus or int(spec.total_mig_slices > 0))
        for key in self._sampled_specs.keys() - runs:
            del self._sampled_specs[key]
        for payload in sample_payloads([(r["job_id"], r["attempt"], r["nodes"]) for r in rows], self._sampled_specs,
                                       self._models, tx.now, interval):
            await tx.emit(payload, subject_suffix=None)


def sample_payloads(runs: list[tuple[str, int, list[str]]], specs: Mapping[tuple[str, int], tuple[float, int]],
                    models: Mapping[str, str], now: float, interval: float) -> list[UtilizationSampled]:
    """One UtilizationSampled per busy node, in node order, for runs (job, attempt, nodes) whose (utilisation %,
    GPUs) `specs` knows. Each node's samples are plain dicts validated once with the node's payload (one call into
    pydantic per node, not one per GPU)."""
    per_node: dict[str, list[dict[str, Any]]] = {}
    for job_id, attempt, nodes in sorted(runs, key=lambda r: r[0]):
        known = specs.get((job_id, attempt))
        if known is None:  # placed again between the two reads: sampled from the next round on
            continue
        util, total_gpus = known
        if total_gpus == 0:
            continue  # a run that holds no GPU (pods without GPUs) has no GPU to sample: no GPU time, no energy
        for node in nodes:
            samples = per_node.setdefault(node, [])
            for gpu in range(max(1, total_gpus // max(1, len(nodes)))):
                value = min(100.0, max(0.0, util + jitter(job_id, gpu, now)))
                samples.append({"job_id": job_id, "gpu_index": len(samples), "utilization_pct": value,
                                "memory_used_mib": int(value * 600), "power_w": round(80 + 6 * value, 1)})
    sampled_at = utcnow_from(now)
    return [UtilizationSampled.model_validate({"node": node, "gpu_model": models[node], "sampled_at": sampled_at,
                                               "interval_s": interval, "samples": per_node[node], "source": "sim"})
            for node in sorted(per_node)]
