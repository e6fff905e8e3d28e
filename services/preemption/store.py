"""Reading the preemption service's tables into core snapshots (shared by the service, the CLI and explain)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import asyncpg

from services.preemption.core import RunningJob, priority_of
from services.scheduler import readmodel
from services.scheduler.core import ClusterState
from shared.config import QueuesConfig, parse_queues
from shared.domain import GpuBinding, JobSpec, NodeSpec

log = logging.getLogger("gpuq.preemption")

HOLDING = ("placed", "running", "preempting")  # statuses in which a job holds GPUs


@dataclass
class Snapshot:
    config: QueuesConfig
    cluster: ClusterState
    running: list[RunningJob]
    busy: set[str] = field(default_factory=set)  # victims of open protocols
    specs: dict[str, JobSpec] = field(default_factory=dict)


async def load_config(conn: asyncpg.Connection, fallback: QueuesConfig | None = None) -> QueuesConfig:
    row = await conn.fetchrow("SELECT document FROM preemption.config ORDER BY version DESC LIMIT 1")
    if row is not None:
        return parse_queues(json.loads(row["document"]), "preemption.config")
    if fallback is None:
        raise LookupError("the preemption service has no queue configuration recorded yet")
    return fallback


def running_job(spec: JobSpec, bindings: list[GpuBinding], nodes: dict[str, NodeSpec], config: QueuesConfig,
                started_at: float, last_checkpoint_at: float | None) -> RunningJob:
    """A running job as a possible victim; its quota usage follows admission's units (docs/admission.md)."""
    value, preemptible, production = priority_of(config, spec)
    queue = config.queue_map.get(spec.queue)
    quotas = queue.quotas if queue is not None else {}
    usage: dict[str, int] = {}
    gpus = 0.0
    for b in sorted(bindings, key=lambda b: (b.node, b.pod)):
        node = nodes.get(b.node)
        model = node.gpu_model if node is not None else "unknown"
        if b.mig_slice is not None and node is not None and node.mig is not None:
            key = f"{model}:{node.mig.profile}"
            usage[key if key in quotas else model] = usage.get(key if key in quotas else model, 0) + 1
            gpus += 1.0 / node.mig.slices_per_gpu
        elif b.gpu_indices:
            usage[model] = usage.get(model, 0) + len(b.gpu_indices)
            gpus += len(b.gpu_indices)
    return RunningJob(job_id=spec.job_id, queue=spec.queue, priority_class=spec.priority_class, priority=value,
                      preemptible=preemptible, production=production, kind=spec.kind, gpus=gpus,
                      usage=dict(sorted(usage.items())), started_at=started_at,
                      max_runtime_s=spec.max_runtime_s, last_checkpoint_at=last_checkpoint_at,
                      checkpointable=spec.checkpoint.supported, checkpoint_cost_s=EXPECTED_CHECKPOINT_S)


# What the victim selector assumes a requested checkpoint costs (the protocol asks before it preempts).
EXPECTED_CHECKPOINT_S = 60.0


async def load_snapshot(conn: asyncpg.Connection, config: QueuesConfig) -> Snapshot:
    # The nodes are the scheduler's fact: read from its read model at decision time (no copy kept here).
    nodes = {n.name: n for n in await readmodel.nodes(conn)}
    cluster = ClusterState.from_nodes(nodes.values())
    running: list[RunningJob] = []
    busy: set[str] = set()
    specs: dict[str, JobSpec] = {}
    rows = await conn.fetch(
        "SELECT job_id, spec, status, bindings, placed_at, started_at, last_checkpoint_at FROM preemption.jobs "
        "WHERE status = ANY($1::text[]) ORDER BY placed_at, job_id", list(HOLDING))
    for r in rows:
        spec = JobSpec.model_validate_json(r["spec"])
        bindings = [GpuBinding.model_validate(b) for b in json.loads(r["bindings"] or "[]")]
        try:
            cluster.commit(cluster.make_placement(spec, bindings))
        except Exception as exc:  # a node vanished: the job is still a candidate, its GPUs just are not there
            log.warning("could not restore placement of %s: %s", spec.job_id, exc)
        started = r["started_at"] if r["started_at"] is not None else r["placed_at"]
        running.append(running_job(spec, bindings, nodes, config, started, r["last_checkpoint_at"]))
        specs[spec.job_id] = spec
        if r["status"] == "preempting":
            busy.add(spec.job_id)
    return Snapshot(config=config, cluster=cluster, running=running, busy=busy, specs=specs)
