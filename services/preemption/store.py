"""The preemption service's view of the cluster at decision time (shared by the service, the CLI and explain).

Nothing here is a copy: the nodes and the running jobs (spec, bindings, placement, the executor-reported start) are
the scheduler's facts, read from its read model (services/scheduler/readmodel.py) when a request is decided; the
protocol (requests, preemptions, which victims are in one) and the last checkpoint each job reported are this
service's own tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import asyncpg

from services.admission import configmodel
from services.core.admission.resources import non_gpu_usage
from services.core.preemption import RunningJob, priority_of
from services.core.scheduler import ClusterState
from services.scheduler import readmodel
from services.scheduler.readmodel import PlacementFact
from shared.config import QueuesConfig, placement_strategies
from shared.domain import MILLI_GPU, GpuBinding, JobSpec, NodeSpec, mig_milli_gpus

log = logging.getLogger("gpuq.preemption")


@dataclass
class Snapshot:
    config: QueuesConfig
    cluster: ClusterState
    running: list[RunningJob]
    busy: set[str] = field(default_factory=set)  # victims of open protocols
    # every placement in force, by job id (`running` less the victims preempted in their current run)
    placements: dict[str, PlacementFact] = field(default_factory=dict)


async def load_config(conn: asyncpg.Connection, fallback: QueuesConfig | None = None) -> QueuesConfig:
    """The queue configuration in force: admission's (its read model; preemption keeps no copy)."""
    current = await configmodel.in_force(conn)
    if current is not None:
        return current.config
    if fallback is None:
        raise LookupError("admission has no queue configuration recorded yet")
    return fallback


def running_job(spec: JobSpec, bindings: list[GpuBinding], nodes: dict[str, NodeSpec], config: QueuesConfig,
                started_at: float, last_checkpoint_at: float | None) -> RunningJob:
    """A running job as a possible victim; its quota usage follows admission's units (docs/admission.md)."""
    value, preemptible, production = priority_of(config, spec)
    queue = config.queue_map.get(spec.queue)
    quotas = queue.quotas if queue is not None else {}
    usage: dict[str, int] = {}
    gpus = 0.0
    shares: dict[str, int] = {}  # model -> milli-GPUs of shared GPUs held without a gpu-share quota
    by_set = {ps.name: ps for ps in spec.pod_sets}
    for b in sorted(bindings, key=lambda b: (b.node, b.pod)):
        node = nodes.get(b.node)
        model = node.gpu_model if node is not None else "unknown"
        ps = by_set.get(b.pod.rsplit("-", 1)[0])
        if b.mig_slice is not None and node is not None and node.mig is not None:
            key = f"{model}:{node.mig.profile}"
            usage[key if key in quotas else model] = usage.get(key if key in quotas else model, 0) + 1
            gpus += 1.0 / node.mig.slices_per_gpu
        elif b.mig_slice is not None and node is not None and node.mig_profiles and ps is not None and ps.mig_profile:
            key = f"{model}:{ps.mig_profile}"  # a slice of a mixed-MIG node: its pod set's profile
            usage[key if key in quotas else model] = usage.get(key if key in quotas else model, 0) + 1
            gpus += mig_milli_gpus(ps.mig_profile) / MILLI_GPU
        elif b.shared_gpu is not None:
            # part of a shared GPU, charged as admission charges it (resources.shared_demand)
            milli = b.share_milli or 0
            gpus += milli / MILLI_GPU
            if ps is not None and ps.gpu_fraction is None and ps.gpu_memory_mib:
                key = f"{model}:gpu-memory"
                usage[key] = usage.get(key, 0) + ps.gpu_memory_mib
            elif f"{model}:gpu-share" in quotas:
                usage[f"{model}:gpu-share"] = usage.get(f"{model}:gpu-share", 0) + milli
            else:
                shares[model] = shares.get(model, 0) + milli
        elif b.gpu_indices:
            usage[model] = usage.get(model, 0) + len(b.gpu_indices)
            gpus += len(b.gpu_indices)
    for model, milli in shares.items():  # the whole GPUs its shares add up to, rounded up
        usage[model] = usage.get(model, 0) + -(-milli // MILLI_GPU)
    usage.update(non_gpu_usage(spec, quotas))  # cpu_milli, memory_mib, pods, pool/<name> where its queue sets them
    return RunningJob(job_id=spec.job_id, queue=spec.queue, priority_class=spec.priority_class, priority=value,
                      preemptible=preemptible, production=production, kind=spec.kind, gpus=gpus,
                      usage=dict(sorted(usage.items())), started_at=started_at,
                      max_runtime_s=spec.max_runtime_s, last_checkpoint_at=last_checkpoint_at,
                      checkpointable=spec.checkpoint.supported, checkpoint_cost_s=EXPECTED_CHECKPOINT_S)


# What the victim selector assumes a requested checkpoint costs (the protocol asks before it preempts).
EXPECTED_CHECKPOINT_S = 60.0


async def last_checkpoints(conn: asyncpg.Connection, job_ids: list[str]) -> dict[str, tuple[float, str | None]]:
    """job -> (time, URI) of the last checkpoint it reported (JobCheckpointed), for the jobs that reported one."""
    rows = await conn.fetch("SELECT job_id, checkpointed_at, uri FROM preemption.checkpoints "
                            "WHERE job_id = ANY($1::text[])", job_ids)
    return {r["job_id"]: (float(r["checkpointed_at"]), r["uri"]) for r in rows}


def run_started(p: PlacementFact) -> float:
    """Start of the placement's run: the executor-reported start, the placement time until it is reported."""
    return p.started_at if p.started_at is not None else p.placed_at


async def load_snapshot(conn: asyncpg.Connection, config: QueuesConfig) -> Snapshot:
    """The nodes and the jobs holding GPUs as the scheduler knows them now (its read model, one snapshot), less
    the victims this service has preempted in their current run and the scheduler has not freed yet; victims of
    an open protocol are `busy`."""
    rows = await readmodel.cluster_rows(conn)
    nodes = {f.name: f.spec for f in readmodel.node_facts_of(rows.nodes)}
    cluster = ClusterState.from_nodes(nodes.values(), queue_strategies=placement_strategies(config))
    placements = readmodel.placements_of(rows.placements)
    ids = [p.job_id for p in placements]
    busy: set[str] = set()
    gone: set[tuple[str, float]] = set()  # (victim, placed_at) preempted in that run
    for r in await conn.fetch("SELECT victim, state, victim_placed_at FROM preemption.preemptions "
                              "WHERE victim = ANY($1::text[]) AND state IN ('checkpointing', 'preempted')", ids):
        if r["state"] == "checkpointing":
            busy.add(r["victim"])
        elif r["victim_placed_at"] is not None:
            gone.add((r["victim"], float(r["victim_placed_at"])))
    checkpoints = await last_checkpoints(conn, ids)
    running: list[RunningJob] = []
    for p in placements:
        if (p.job_id, p.placed_at) in gone:
            continue  # JobPreempted is on its way to the scheduler: its GPUs are as good as free
        try:
            cluster.commit(cluster.make_placement(p.spec, list(p.bindings)))
        except Exception as exc:  # a node vanished: the job is still a candidate, its GPUs just are not there
            log.warning("could not restore placement of %s: %s", p.job_id, exc)
        last = checkpoints.get(p.job_id)
        running.append(running_job(p.spec, list(p.bindings), nodes, config, run_started(p),
                                   last[0] if last is not None else None))
    return Snapshot(config=config, cluster=cluster, running=running, busy=busy,
                    placements={p.job_id: p for p in placements})
