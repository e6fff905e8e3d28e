"""What could be taken now, and why: shared by `gpuq preemptible` and `gpuq explain`."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from services.admission import readmodel as admission_view
from services.core.preemption import RunningJob, class_verdict, is_borrowing, protection, usage_by_queue
from services.preemption.store import Snapshot, load_config, load_snapshot
from services.scheduler import readmodel as scheduler_view
from shared.config import PreemptionPolicy, QueuesConfig


@dataclass(frozen=True)
class Exposure:
    job_id: str
    queue: str
    priority_class: str
    gpus: float
    takeable: bool
    why: str  # machine reason it is not takeable, or "Takeable"
    by: str  # who could take it
    lost_gpu_seconds: float
    protected_until: float | None


def exposure(job: RunningJob, snap: Snapshot, now: float) -> Exposure:
    config = snap.config
    usage = usage_by_queue(snap.running)
    why = class_verdict(job)
    until = None
    if why is None and job.job_id in snap.busy:
        why = "AlreadyBeingPreempted"
    if why is None:
        window = protection(job, now, config.policy.protection_window_s)
        if window is not None:
            why, until = window
    return Exposure(job.job_id, job.queue, job.priority_class, job.gpus, why is None, why or "Takeable",
                    takers(job, config, usage), job.lost_gpu_seconds(now), until)


def takers(job: RunningJob, config: QueuesConfig, usage: dict[str, dict[str, int]]) -> str:
    parts: list[str] = []
    q = config.queue_map.get(job.queue)
    if q is not None and q.preemption.within_queue is not PreemptionPolicy.NEVER:
        parts.append(f"higher-priority jobs of {job.queue} (priority > {job.priority})")
    if q is not None and q.cohort is not None and is_borrowing(job.queue, (), usage, config):
        root = config.cohort_root(q.cohort)
        reclaimers = sorted(o.name for o in config.queues
                            if config.cohort_root(o.cohort) == root and o.name != job.queue
                            and o.preemption.reclaim_within_cohort is not PreemptionPolicy.NEVER)
        if reclaimers:
            where = f"cohort {q.cohort}" if root == q.cohort else f"cohort tree {root}"
            parts.append(f"queues reclaiming in {where} ({', '.join(reclaimers)}): {job.queue} borrows")
    if job.kind.value == "inference":
        parts.append("never by training jobs")
    return "; ".join(parts) or "nobody (no queue policy allows it)"


async def preemptible_in_queue(conn: asyncpg.Connection, queue: str | None, now: float,
                               fallback: QueuesConfig | None = None) -> list[Exposure]:
    config = await load_config(conn, fallback)
    snap = await load_snapshot(conn, config)
    jobs = [j for j in snap.running if queue is None or j.queue == queue]
    out = [exposure(j, snap, now) for j in jobs]
    # takeable first, then the order victims are considered in: least lost work, lowest priority, newest
    return sorted(out, key=lambda e: (not e.takeable, e.lost_gpu_seconds, e.job_id))


async def preemption_status(conn: asyncpg.Connection, job_id: str, now: float | None = None) -> list[str]:
    """Lines for `gpuq explain JOB`: whether a running job may be preempted now, by what, and its history."""
    import time

    now = time.time() if now is None else now
    try:
        config = await load_config(conn)
    except LookupError:
        return ["preemption: admission has recorded no queue configuration yet"]
    lines: list[str] = []
    # Whether it runs is the scheduler's fact (its read model), what else became of it admission's.
    if not await scheduler_view.placements(conn, [job_id]):
        fact = await admission_view.job(conn, job_id)
        lines.append("preemption: no record of this job" if fact is None else
                     f"preemption: the job is not running ({fact.status}), nothing to preempt")
    else:
        snap = await load_snapshot(conn, config)
        job = next((j for j in snap.running if j.job_id == job_id), None)
        if job is None:
            lines.append("preemption: the job was just preempted, its GPUs are being freed")
        else:
            e = exposure(job, snap, now)
            if e.takeable:
                lines.append(f"preemption: may be preempted now by {e.by}; it would lose "
                             f"{e.lost_gpu_seconds:.0f} GPU-seconds since its last checkpoint")
            elif e.protected_until is not None:
                lines.append(f"preemption: protected ({e.why}) for another {e.protected_until - now:.0f}s")
            else:
                lines.append(f"preemption: cannot be preempted ({e.why})")
    for r in await conn.fetch(
            "SELECT preemptor, reason, state, lost_gpu_seconds, checkpoint_uri, requested_at FROM "
            "preemption.preemptions WHERE victim = $1 ORDER BY requested_at", job_id):
        lost = f", lost {r['lost_gpu_seconds']:.0f} GPU-s" if r["lost_gpu_seconds"] is not None else ""
        ckpt = f", resumes from {r['checkpoint_uri']}" if r["checkpoint_uri"] else ""
        lines.append(f"preemption: {r['state']} for {r['preemptor']} ({r['reason']}){lost}{ckpt}")
    for r in await conn.fetch("SELECT outcome, message FROM preemption.requests WHERE preemptor = $1 "
                              "ORDER BY requested_at DESC LIMIT 3", job_id):
        lines.append(f"preemption: as preemptor — {r['outcome']}: {r['message']}")
    return lines
