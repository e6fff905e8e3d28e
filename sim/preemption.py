"""The preemption step of the simulator's `gpuq` policy: the preemption core, driven from sim/policies/gpuq.py.

Wiring (sim/run.py):
    from sim.preemption import SimPreemption
    GpuqPolicy(preemption_hook=SimPreemption(trace.queues, checkpointing=True))
`SimPreemption` is a `PreemptionHook`: called with the cycle's `PreemptionContext`, it returns the victims as
`sim.engine.Preempted` (the policy's `_requeue` frees them and admission requeues them).

The simulator has no checkpoint round trip, so the protocol is folded into the instant: with
`checkpointing=True` a checkpointable victim loses only `checkpoint_write_s` of its GPUs' time (the
checkpoint it writes on request; nothing since is lost); without, it loses every GPU-second since its
start (or since its last periodic checkpoint when its spec has `checkpoint.interval_s`).
Guard rails are kept across cycles: the per-queue hourly limit and the no-cascade cool-down. Every request of
a cycle is decided (the service decides every PreemptionRequested it receives); `max_preemptors_per_cycle`
caps them only when a what-if run asks for it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.preemption.core import (
    PRIORITY,
    RECLAIM,
    Preemptor,
    RunningJob,
    cooldown_verdict,
    priority_of,
    protection_ends,
    rate_limit_verdict,
    select_victims,
)
from shared.config import QueuesConfig
from shared.domain import JobSpec
from sim.engine import Preempted

# How long before a running job's next periodic checkpoint its view is looked at again (seconds; far above the
# rounding of a sum of floats of this size, far below any checkpoint interval).
_DUE_MARGIN_S = 1e-3


def _last_checkpoint(started_at: float, interval: float, now: float) -> float:
    """When the job's last periodic checkpoint was written (at its start when none yet)."""
    return started_at + ((now - started_at) // interval) * interval


class SimPreemption:
    def __init__(self, queues: QueuesConfig, *, checkpointing: bool = True, checkpoint_write_s: float = 30.0,
                 max_preemptors_per_cycle: int | None = None):
        self.config = queues
        self.checkpointing = checkpointing
        self.checkpoint_write_s = checkpoint_write_s
        self.max_preemptors_per_cycle = max_preemptors_per_cycle
        self.last_preempted: dict[str, float] = {}
        self.by_queue: dict[str, list[float]] = {}
        self._jobs: dict[str, RunningJob] = {}  # job id -> its RunningJob for its current run
        self._seen: dict[str, Any] = {}  # the policy's running jobs (RunningInfo) when `_jobs` was last synced
        self._due: list[tuple[float, str, float]] = []  # (next checkpoint due, job id, its run's start)
        self._list: list[RunningJob] = []  # `_jobs` in job id order
        self.protected_violations = 0  # victims inside the window or of non-preemptible classes (must stay 0)
        # after a call: when the first job that protected itself from a request (young) leaves its window
        self.next_wake: float | None = None

    def _running(self, ctx: Any) -> list[RunningJob]:
        """The running jobs as the preemption core sees them, in job id order. Each is built once per run
        (start) and only its last periodic checkpoint is moved as time passes: rebuilding every running job
        on every call was a third of a deep-backlog replay. Kept incrementally: the list is rebuilt only when
        the running jobs changed (the policy's dict compared with the one last seen: the same RunningInfo
        objects compare by identity) or a job passed a checkpoint (a heap of when each job's next periodic
        checkpoint is due); a scan of every running job on every call was a seventh of the 60-day replay."""
        running: Mapping[str, Any] = ctx.running
        now: float = ctx.now
        jobs = self._jobs
        changed = False
        if running != self._seen:
            for job_id in [j for j in jobs if j not in running]:
                del jobs[job_id]
            for job_id, info in running.items():
                job = jobs.get(job_id)
                if job is None or job.started_at != info.started_at:
                    job = jobs[job_id] = self._build(job_id, info, now)
                    interval = info.spec.checkpoint.interval_s
                    if interval:
                        heapq.heappush(self._due, (self._next_due(job, interval), job_id, info.started_at))
            self._seen = dict(running)
            changed = True
        due = self._due
        while due and due[0][0] <= now:
            _, job_id, started_at = heapq.heappop(due)
            job = jobs.get(job_id)
            if job is None or job.started_at != started_at:
                continue  # ended, or restarted (its new run has its own entry)
            interval = running[job_id].spec.checkpoint.interval_s
            last = _last_checkpoint(started_at, interval, now)
            if last != job.last_checkpoint_at:
                job = jobs[job_id] = replace(job, last_checkpoint_at=last)
                changed = True
            heapq.heappush(due, (max(self._next_due(job, interval), math.nextafter(now, math.inf)), job_id,
                                 started_at))
        if changed:
            self._list = [jobs[j] for j in sorted(jobs)]
        return self._list

    def _build(self, job_id: str, info: Any, now: float) -> RunningJob:
        spec: JobSpec = info.spec
        interval = spec.checkpoint.interval_s
        last = _last_checkpoint(info.started_at, interval, now) if interval else None
        value, preemptible, production = priority_of(self.config, spec)
        model = spec.gpu_models[0] if spec.gpu_models else "gpu"
        usage = {model: spec.total_gpus} if spec.total_gpus else {}
        return RunningJob(job_id=job_id, queue=spec.queue, priority_class=spec.priority_class,
                          priority=value, preemptible=preemptible, production=production, kind=spec.kind,
                          gpus=float(spec.total_gpus or 1), usage=usage, started_at=info.started_at,
                          max_runtime_s=spec.max_runtime_s, last_checkpoint_at=last,
                          checkpointable=spec.checkpoint.supported,
                          checkpoint_cost_s=self.checkpoint_write_s if self.checkpointing else None)

    @staticmethod
    def _next_due(job: RunningJob, interval: float) -> float:
        """A little before the job's next periodic checkpoint (the margin covers float rounding of the sum):
        until then `_last_checkpoint` cannot change; at it, it is recomputed and compared."""
        base = job.started_at if job.last_checkpoint_at is None else job.last_checkpoint_at
        return base + interval - _DUE_MARGIN_S

    def __call__(self, ctx: Any) -> list[Any]:
        running = self._running(ctx)
        self.next_wake = None
        usage_by_allocation = ctx.cluster.allocations()
        requests: list[tuple[str, str, dict[str, int], dict[str, int], int | None]] = []
        for u in ctx.unplaceable:
            requests.append((u.job_id, PRIORITY, {}, {}, None))
        for r in ctx.reclaims:  # admission's: reclaims, and within-queue preemptions (reason PriorityPreemption)
            requests.append((r.preemptor, RECLAIM if r.reason == RECLAIM else PRIORITY, dict(r.need),
                             dict(getattr(r, "own_need", {})), getattr(r, "max_victim_priority", None)))
        taken: set[str] = set()
        out: list[Any] = []
        cluster = ctx.cluster.copy()  # victims of earlier preemptors this cycle are released on the copy
        # Every request is decided, as the preemption service decides every PreemptionRequested it receives;
        # a cap (for what-if runs) keeps the first ones in order: unplaceable admitted jobs, then reclaims.
        cap = self.max_preemptors_per_cycle
        for job_id, reason, need, own_need, max_victim in requests if cap is None else requests[:cap]:
            spec = self._spec(ctx, job_id)
            if spec is None or cooldown_verdict(self.config, self.last_preempted.get(job_id), ctx.now):
                continue
            preemptor = Preemptor(job_id=job_id, queue=spec.queue, priority=priority_of(self.config, spec)[0],
                                  kind=spec.kind, spec=spec, reason=reason,
                                  allowed_models=tuple(sorted({k.split(":", 1)[0] for k in need})), need=need,
                                  own_need=own_need, max_victim_priority=max_victim)
            alive = [j for j in running if j.job_id not in taken and j.job_id in usage_by_allocation]
            sel = select_victims(preemptor, alive, cluster, self.config, ctx.now, exact_pool=6)
            if not sel.victims:
                self._wake_when_unprotected(alive, sel.rejected, ctx.now)
                continue
            recent = self.by_queue.setdefault(spec.queue, [])
            if rate_limit_verdict(self.config, spec.queue, recent, ctx.now, len(sel.victims)):
                continue
            for v in sel.victims:
                job = next(j for j in alive if j.job_id == v)
                if job.production or not job.preemptible or ctx.now - job.started_at < ctx.protection_window_s:
                    self.protected_violations += 1
                if self.checkpointing and job.checkpointable:
                    lost = job.gpus * min(self.checkpoint_write_s, ctx.now - job.started_at)
                else:
                    lost = job.lost_gpu_seconds(ctx.now)
                out.append(Preempted(job_id=v, lost_gpu_s=lost, reason=reason))
                taken.add(v)
                cluster.release(v)
                recent.append(ctx.now)
                self.last_preempted[v] = ctx.now
        return out

    def _wake_when_unprotected(self, alive: list[RunningJob], rejected: Mapping[str, str], now: float) -> None:
        # the same rule as the service's deferred requests (services/preemption/app.py)
        until = protection_ends(alive, rejected, now, self.config.policy.protection_window_s)
        if until is not None:
            self.next_wake = until if self.next_wake is None else min(self.next_wake, until)

    @staticmethod
    def _spec(ctx: Any, job_id: str) -> JobSpec | None:
        adm = ctx.admission
        for source in (adm.admitted, adm.pending):
            w = source.get(job_id)
            if w is not None:
                return w.spec
        return None
