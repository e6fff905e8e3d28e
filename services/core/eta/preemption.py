"""The preemption service, simulated over snapshots: the production preemption core (services/core/preemption)
driven as the service drives it, for the ETA's replay (services/core/eta/eta.py, `ReplayPreemption`) and for the
simulator's `gpuq` policy (sim/policies/gpuq.py, sim/run.py):
    from services.core.eta.preemption import SimPreemption
    GpuqPolicy(preemption_hook=SimPreemption(trace.queues, checkpointing=True))
`SimPreemption` is a `PreemptionHook`: called with the cycle's `PreemptionContext`, it returns the victims as
`Preempted` (the simulator's policy frees them and admission requeues them; the ETA's replay sends them back to
wait with the run time they had left). It lives with the ETA, not in the simulator, because the admission service
runs the ETA: the service image carries neither the simulator's extra nor anything above the cores.

There is no checkpoint round trip in a replay, so the protocol is folded into the instant: with
`checkpointing=True` a checkpointable victim loses only `checkpoint_write_s` of its GPUs' time (the
checkpoint it writes on request; nothing since is lost); without, it loses every GPU-second since its
start (or since its last periodic checkpoint when its spec has `checkpoint.interval_s`).
Guard rails are kept across cycles: the per-queue hourly limit and the no-cascade cool-down. Every request of
a cycle is decided (the service decides every PreemptionRequested it receives); `max_preemptors_per_cycle`
caps them only when a what-if run asks for it.

Pure: no I/O, no clock (callers pass `now`), no randomness.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.core.preemption import (
    PRIORITY,
    RECLAIM,
    Preemptor,
    RunningJob,
    Why,
    cooldown_ends,
    cooldown_verdict,
    priority_of,
    protection_ends,
    rate_limit_verdict,
    select_victims,
)
from shared.config import QueuesConfig
from shared.domain import JobSpec


@dataclass(frozen=True)
class Preempted:
    """A victim: a running job stopped, back to waiting."""

    job_id: str
    lost_gpu_s: float  # GPU-seconds of work lost since the victim's last checkpoint
    reason: str = "PriorityPreemption"
    preemptor: str | None = None  # the job it was preempted for (its freed capacity is held for it)


@dataclass(frozen=True)
class RunningInfo:
    spec: JobSpec
    started_at: float
    expected_end: float  # started_at + max_runtime_s: what the schedulers believe


@dataclass(frozen=True)
class PreemptionContext:
    """What a preemption core needs to pick victims: the snapshot after this cycle's placements."""

    now: float
    cluster: Any  # services.core.scheduler.ClusterState (do not mutate: return victims instead)
    admission: Any  # services.core.admission.AdmissionState
    unplaceable: Sequence[Any]  # scheduler Unplaceable of admitted jobs still waiting, in order
    reclaims: Sequence[Any]  # admission ReclaimRequest list of this cycle
    running: dict[str, RunningInfo]
    protection_window_s: int
    checkpoint_grace_s: int
    # every job id that entered or left `running`, in order, since the policy's setup (the hook keeps its view
    # of the running jobs by reading what was appended since its last call)
    running_log: list[str] | None = None


PreemptionHook = Callable[[PreemptionContext], list[Preempted]]

# How long before a running job's next periodic checkpoint its view is looked at again (seconds; far above the
# rounding of a sum of floats of this size, far below any checkpoint interval).
_DUE_MARGIN_S = 1e-3


def _moved_checkpoint(job: RunningJob, last: float) -> RunningJob:
    """`dataclasses.replace(job, last_checkpoint_at=last)`, without its per-call inspection of the fields (a
    running job passes a periodic checkpoint many times in a long replay)."""
    moved = object.__new__(RunningJob)
    moved.__dict__.update(job.__dict__)
    moved.__dict__["last_checkpoint_at"] = last
    return moved


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
        self._log: list[str] | None = None  # the policy's running log (job ids that started or stopped) ...
        self._log_at = 0  # ... and how much of it `_jobs` has seen
        self._due: list[tuple[float, str, float]] = []  # (next checkpoint due, job id, its run's start)
        self._ids: list[str] = []  # `_jobs`' ids, sorted
        self._list: list[RunningJob] = []  # `_jobs` in job id order
        self._usage: dict[str, dict[str, int]] = {}  # usage_by_queue(self._list), kept as jobs come and go
        self._jobs_of: dict[str, int] = {}  # queue -> its running jobs
        self._holders: dict[tuple[str, str], int] = {}  # (queue, resource) -> its running jobs holding some
        self.protected_violations = 0  # victims inside the window or of non-preemptible classes (must stay 0)
        # after a call: when the first request held back is decided again (the first young job that protected
        # itself from one leaves its window, or a preemptor's cool-down ends)
        self.next_wake: float | None = None

    def _running(self, ctx: Any) -> list[RunningJob]:
        """The running jobs as the preemption core sees them, in job id order. Each is built once per run
        (start) and only its last periodic checkpoint is moved as time passes: rebuilding every running job
        on every call was a third of a deep-backlog replay. Kept incrementally, with their usage per queue
        (`usage_by_queue` of the list): only the jobs that started or stopped since the last call are looked
        at (the policy's `running_log` names them; without one, the policy's dict is compared with the one
        last seen, the same RunningInfo objects comparing by identity), and the jobs that passed a periodic
        checkpoint (a heap of when each one is due); a scan of every running job on every call was a seventh
        of the 60-day replay."""
        running: Mapping[str, Any] = ctx.running
        now: float = ctx.now
        jobs = self._jobs
        log: list[str] | None = getattr(ctx, "running_log", None)
        if log is None or log is not self._log:
            # no log (or a new one): every job whose run differs from the one last seen
            changed: Iterable[str] = ()
            if running != self._seen:
                changed = [j for j in jobs if j not in running] + list(running)
                self._seen = dict(running)
            if log is not None:
                self._log, self._log_at = log, len(log)
        else:  # the same log as last time: what was appended since
            changed = dict.fromkeys(self._log[self._log_at:])
            self._log_at = len(self._log)
        for job_id in changed:
            info = running.get(job_id)
            job = jobs.get(job_id)
            if info is None:
                if job is not None:
                    self._drop(job_id, job)
            elif job is None or job.started_at != info.started_at:
                built = self._build(job_id, info, now)
                self._put(job_id, built, job)
                interval = info.spec.checkpoint.interval_s
                if interval:
                    heapq.heappush(self._due, (self._next_due(built, interval), job_id, info.started_at))
        due = self._due
        while due and due[0][0] <= now:
            _, job_id, started_at = heapq.heappop(due)
            job = jobs.get(job_id)
            if job is None or job.started_at != started_at:
                continue  # ended, or restarted (its new run has its own entry)
            interval = running[job_id].spec.checkpoint.interval_s
            last = _last_checkpoint(started_at, interval, now)
            if last != job.last_checkpoint_at:
                job = _moved_checkpoint(job, last)
                self._put(job_id, job, jobs[job_id])
            heapq.heappush(due, (max(self._next_due(job, interval), math.nextafter(now, math.inf)), job_id,
                                 started_at))
        return self._list

    def _put(self, job_id: str, job: RunningJob, old: RunningJob | None) -> None:
        """`job` is now `job_id`'s view (replacing `old`), in `_list` at its place in job id order."""
        self._jobs[job_id] = job
        i = bisect.bisect_left(self._ids, job_id)
        if old is not None:
            self._list[i] = job
            self._count(old, -1)
        else:
            self._ids.insert(i, job_id)
            self._list.insert(i, job)
        self._count(job, 1)

    def _drop(self, job_id: str, job: RunningJob) -> None:
        del self._jobs[job_id]
        i = bisect.bisect_left(self._ids, job_id)
        del self._ids[i]
        del self._list[i]
        self._count(job, -1)

    def _count(self, job: RunningJob, sign: int) -> None:
        """Add (sign 1) or take away (-1) the job's usage in `_usage`, which holds, as `usage_by_queue` of the
        running jobs does, a queue while one of its jobs runs and a resource while one of its jobs holds it."""
        q = job.queue
        jobs_of = self._jobs_of
        left = jobs_of.get(q, 0) + sign
        usage = self._usage.setdefault(q, {})
        for r, amount in job.usage.items():
            key = (q, r)
            held = self._holders.get(key, 0) + sign
            if held:
                self._holders[key] = held
                usage[r] = usage.get(r, 0) + sign * amount
            else:
                del self._holders[key]
                del usage[r]
        if left:
            jobs_of[q] = left
        else:
            del jobs_of[q]
            del self._usage[q]

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
        # every running job holds its allocation (the usual case): until a victim is taken, a request judges the
        # whole list, whose usage per queue is kept
        whole = ctx.running.keys() <= usage_by_allocation.keys()
        requests: list[tuple[str, str, dict[str, int], dict[str, int], int | None]] = []
        for u in ctx.unplaceable:
            requests.append((u.job_id, PRIORITY, {}, {}, None))
        for r in ctx.reclaims:  # admission's: reclaims, and within-queue preemptions (reason PriorityPreemption)
            requests.append((r.preemptor, RECLAIM if r.reason == RECLAIM else PRIORITY, dict(r.need),
                             dict(getattr(r, "own_need", {})), getattr(r, "max_victim_priority", None)))
        taken: set[str] = set()
        out: list[Any] = []
        # victims of earlier preemptors this cycle are released on a copy, made at the first victim (selection
        # only queries the state: until then the live one answers the same)
        cluster = ctx.cluster
        # Every request is decided, as the preemption service decides every PreemptionRequested it receives;
        # a cap (for what-if runs) keeps the first ones in order: unplaceable admitted jobs, then reclaims.
        cap = self.max_preemptors_per_cycle
        for job_id, reason, need, own_need, max_victim in requests if cap is None else requests[:cap]:
            spec = self._spec(ctx, job_id)
            if spec is None:
                continue
            last = self.last_preempted.get(job_id)
            if cooldown_verdict(self.config, last, ctx.now):
                # the service defers it to the end of the cool-down (services/preemption/app.py)
                self._wake_at(cooldown_ends(self.config, last))
                continue
            preemptor = Preemptor(job_id=job_id, queue=spec.queue, priority=priority_of(self.config, spec)[0],
                                  kind=spec.kind, spec=spec, reason=reason,
                                  allowed_models=tuple(sorted({k.split(":", 1)[0] for k in need})), need=need,
                                  own_need=own_need, max_victim_priority=max_victim)
            if whole and not taken:
                alive, usage = running, self._usage
            else:
                alive = [j for j in running if j.job_id not in taken and j.job_id in usage_by_allocation]
                usage = None
            sel = select_victims(preemptor, alive, cluster, self.config, ctx.now, exact_pool=6, usage=usage)
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
                out.append(Preempted(job_id=v, lost_gpu_s=lost, reason=reason, preemptor=job_id))
                taken.add(v)
                if cluster is ctx.cluster:
                    cluster = ctx.cluster.copy()
                cluster.release(v)
                recent.append(ctx.now)
                self.last_preempted[v] = ctx.now
        return out

    def _wake_when_unprotected(self, alive: list[RunningJob], rejected: Mapping[str, str], now: float) -> None:
        # the same rule as the service's deferred requests (services/preemption/app.py), asked of the jobs it can
        # find (rejected as just started; `rejected` judged exactly `alive`) instead of every running job
        young = [self._jobs[j] for j, why in rejected.items() if why == Why.JUST_STARTED]
        self._wake_at(protection_ends(young, rejected, now, self.config.policy.protection_window_s))

    def _wake_at(self, until: float | None) -> None:
        """A request held back until `until` is decided again then (`next_wake`: the earliest such time)."""
        if until is not None:
            self.next_wake = until if self.next_wake is None else min(self.next_wake, until)

    @staticmethod
    def _spec(ctx: Any, job_id: str) -> JobSpec | None:
        adm = ctx.admission
        for source in (adm.admitted, adm.pending):
            w = source.get(job_id)
            if w is not None:
                spec: JobSpec = w.spec
                return spec
        return None
