"""The pipeline's preemption stage: who is preempted for whom, decided in the pass that found the preemptor
unplaceable (`decide`, loop.py), by the preemption core's rules.

- `choose_victims`: one request's victims or why none, the one rule the pipeline's pass and the preemption
  service (services/preemption/app.py) both apply: the preemptor's no-cascade cool-down, victim selection
  (`select_victims`: classes, kinds, queues and cohorts, the protection window, the loss bound, least lost
  work, the borrowers' guarantees), the retry time when only protection stands in the way, and the preemptor
  queue's hourly limit.
- `VictimChooser`: every request of a pass in order, with the guard rails' memory across passes and the view of
  the running jobs; its victims are `Preempted`.

There is no checkpoint round trip inside a pass: with checkpointing a checkpointable victim loses only
`checkpoint_write_s` of its GPUs' time (the checkpoint it writes on request); without, every GPU-second since
its start (or since its last periodic checkpoint when its spec has `checkpoint.interval_s`). The services run
the protocol itself (checkpoint first, within the grace) on the decision.

Pure: no I/O, no clock (callers pass `now`), no randomness.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.core.admission.resources import non_gpu_usage
from services.core.preemption import (
    PRIORITY,
    RECLAIM,
    Outcome,
    Preemptor,
    RunningJob,
    Selection,
    cooldown_ends,
    cooldown_verdict,
    priority_of,
    protection_ends,
    rate_limit_verdict,
    select_victims,
)
from services.core.preemption.select import EXACT_POOL
from services.core.scheduler import ClusterState
from shared.config import QueuesConfig
from shared.domain import JobSpec
from shared.quota_keys import is_non_gpu


@dataclass(frozen=True)
class Choice:
    """One request's answer: its victims (outcome STARTED), or the outcome and why not. `retry_at`: when deciding
    it again may answer otherwise (the end of the preemptor's cool-down, or of the earliest protection window
    that kept a candidate out); the service defers a COOLDOWN or DEFERRED request to then."""

    outcome: str  # services.core.preemption.Outcome
    victims: tuple[str, ...] = ()
    lost_gpu_seconds: float = 0.0
    why: str = ""  # the cool-down's or the rate limit's message, or the selection's machine reason
    retry_at: float | None = None
    selection: Selection | None = field(default=None, compare=False)


def choose_victims(preemptor: Preemptor, running: Sequence[RunningJob], cluster: ClusterState,
                   config: QueuesConfig, now: float, *, last_preempted: float | None,
                   recent_victim_times: Iterable[float], busy: Collection[str] = (),
                   usage: Mapping[str, Mapping[str, int]] | None = None, exact_pool: int = EXACT_POOL) -> Choice:
    """The victims for `preemptor` now, by the preemption core's rules, or why none. `last_preempted`: when the
    preemptor was itself last preempted (its cool-down); `recent_victim_times`: when its queue's victims of the
    last hour were taken (the hourly limit); `busy`: jobs already in a preemption protocol; `usage`: the running
    jobs' usage per queue when the caller keeps it. `cluster` is only queried."""
    why = cooldown_verdict(config, last_preempted, now)
    if why is not None:
        return Choice(Outcome.COOLDOWN, why=why, retry_at=cooldown_ends(config, last_preempted))
    sel = select_victims(preemptor, running, cluster, config, now, busy=busy, exact_pool=exact_pool, usage=usage)
    if not sel.victims:
        retry_at = protection_ends(running, sel.rejected, now, config.policy.protection_window_s)
        outcome = (Outcome.FITS if sel.why == "FitsWithoutPreemption"
                   else Outcome.DEFERRED if retry_at is not None else Outcome.NO_VICTIMS)
        return Choice(outcome, why=sel.why, retry_at=retry_at, selection=sel)
    limited = rate_limit_verdict(config, preemptor.queue, recent_victim_times, now, len(sel.victims))
    if limited is not None:
        return Choice(Outcome.RATE_LIMITED, victims=sel.victims, why=limited, selection=sel)
    return Choice(Outcome.STARTED, victims=sel.victims, lost_gpu_seconds=sel.lost_gpu_seconds, selection=sel)


@dataclass(frozen=True)
class Preempted:
    """A victim: a running job stopped, back to waiting."""

    job_id: str
    lost_gpu_s: float  # GPU-seconds of work lost since the victim's last checkpoint
    reason: str = "PriorityPreemption"  # PRIORITY or RECLAIM
    preemptor: str | None = None  # the job it was preempted for (its freed capacity is held for it)
    # the checkpoint protocol: the victim is asked to checkpoint first, within `grace_s` (a replay folds it into
    # the instant: `lost_gpu_s` is then what the checkpoint's writing costs)
    checkpoint_first: bool = False
    grace_s: float = 0.0


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


class VictimChooser:
    """The victim choice of the pipeline's preemption stage, with the memory it keeps across passes: the guard
    rails (each victim's last preemption for the no-cascade cool-down, each queue's victims for the hourly
    limit) and its incrementally kept view of the running jobs. Called with a pass's `PreemptionContext`, it
    decides every request in order through `choose_victims` (the rule the preemption service applies to each
    PreemptionRequested) and returns the victims as `Preempted`, releasing them on a copy of the cluster so a
    later request of the same pass sees the capacity already taken. `max_preemptors_per_cycle` caps the requests
    decided per pass only when a what-if run asks for it."""

    def __init__(self, queues: QueuesConfig, *, checkpointing: bool = True, checkpoint_write_s: float = 30.0,
                 max_preemptors_per_cycle: int | None = None):
        self.config = queues
        self.checkpointing = checkpointing
        self.checkpoint_write_s = checkpoint_write_s
        self.max_preemptors_per_cycle = max_preemptors_per_cycle
        self.last_preempted: dict[str, float] = {}
        self.by_queue: dict[str, list[float]] = {}
        # reclaiming job -> when its request was first decided (until it gets victims): how long victim selection
        # may wait for cheaper borrowers to leave their protection window (`Preemptor.waiting_since`)
        self.reclaim_asked: dict[str, float] = {}
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

    def _running(self, ctx: PreemptionContext) -> list[RunningJob]:
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
        queue = self.config.queue_map.get(spec.queue)
        if queue is not None:  # cpu_milli, memory_mib, pods, pool/<name>: what admission charged besides GPUs
            usage.update(non_gpu_usage(spec, queue.quotas))
        return RunningJob(job_id=job_id, queue=spec.queue, priority_class=spec.priority_class,
                          priority=value, preemptible=preemptible, production=production, kind=spec.kind,
                          gpus=float(spec.total_gpus or spec.total_share_milli / 1000 or 1), usage=usage,
                          started_at=info.started_at,
                          max_runtime_s=spec.max_runtime_s, last_checkpoint_at=last,
                          checkpointable=spec.checkpoint.supported,
                          checkpoint_cost_s=self.checkpoint_write_s if self.checkpointing else None)

    @staticmethod
    def _next_due(job: RunningJob, interval: float) -> float:
        """A little before the job's next periodic checkpoint (the margin covers float rounding of the sum):
        until then `_last_checkpoint` cannot change; at it, it is recomputed and compared."""
        base = job.started_at if job.last_checkpoint_at is None else job.last_checkpoint_at
        return base + interval - _DUE_MARGIN_S

    def __call__(self, ctx: PreemptionContext) -> list[Preempted]:
        """The victims of the pass's requests, in order: the unplaceable jobs that ask for preemption, then
        admission's reclaims (and within-queue preemptions). `next_wake`: when the first request held back (by a
        cool-down or a protection window) is worth deciding again."""
        running = self._running(ctx)
        self.next_wake = None
        usage_by_allocation = ctx.cluster.allocations()
        # every running job holds its allocation (the usual case): until a victim is taken, a request judges the
        # whole list, whose usage per queue is kept
        whole = ctx.running.keys() <= usage_by_allocation.keys()
        taken: set[str] = set()
        out: list[Preempted] = []
        # victims of earlier preemptors this pass are released on a copy, made at the first victim (selection
        # only queries the state: until then the live one answers the same)
        cluster = ctx.cluster
        requests = _requests(ctx)
        cap = self.max_preemptors_per_cycle
        for job_id, reason, need, own_need, max_victim in requests if cap is None else requests[:cap]:
            spec = self._spec(ctx, job_id)
            if spec is None:
                continue
            preemptor = Preemptor(job_id=job_id, queue=spec.queue, priority=priority_of(self.config, spec)[0],
                                  kind=spec.kind, spec=spec, reason=reason,
                                  allowed_models=tuple(sorted({k.split(":", 1)[0] for k in need if not is_non_gpu(k)})),
                                  need=need,
                                  own_need=own_need, max_victim_priority=max_victim,
                                  waiting_since=self.reclaim_asked.setdefault(job_id, ctx.now)
                                  if reason == RECLAIM else None)
            if whole and not taken:
                alive, usage = running, self._usage
            else:
                alive = [j for j in running if j.job_id not in taken and j.job_id in usage_by_allocation]
                usage = None
            recent = self.by_queue.setdefault(spec.queue, [])
            choice = choose_victims(preemptor, alive, cluster, self.config, ctx.now,
                                    last_preempted=self.last_preempted.get(job_id), recent_victim_times=recent,
                                    usage=usage, exact_pool=6)
            if choice.outcome != Outcome.STARTED:
                if choice.outcome != Outcome.RATE_LIMITED:
                    # the service defers it to then (services/preemption/app.py)
                    self._wake_at(choice.retry_at)
                continue
            self.reclaim_asked.pop(job_id, None)
            for v in choice.victims:
                job = next(j for j in alive if j.job_id == v)
                out.append(self._preempted(job, ctx, reason, job_id))
                taken.add(v)
                if cluster is ctx.cluster:
                    cluster = ctx.cluster.copy()
                cluster.release(v)
                recent.append(ctx.now)
                self.last_preempted[v] = ctx.now
        return out

    def _preempted(self, job: RunningJob, ctx: PreemptionContext, reason: str, preemptor: str) -> Preempted:
        now = ctx.now
        if job.production or not job.preemptible or now - job.started_at < ctx.protection_window_s:
            self.protected_violations += 1
        checkpoint = self.checkpointing and job.checkpointable
        if checkpoint:
            lost = job.gpus * min(self.checkpoint_write_s, now - job.started_at)
        else:
            lost = job.lost_gpu_seconds(now)
        return Preempted(job_id=job.job_id, lost_gpu_s=lost, reason=reason, preemptor=preemptor,
                         checkpoint_first=checkpoint and ctx.checkpoint_grace_s > 0,
                         grace_s=float(ctx.checkpoint_grace_s))

    def _wake_at(self, until: float | None) -> None:
        """A request held back until `until` is decided again then (`next_wake`: the earliest such time)."""
        if until is not None:
            self.next_wake = until if self.next_wake is None else min(self.next_wake, until)

    @staticmethod
    def _spec(ctx: PreemptionContext, job_id: str) -> JobSpec | None:
        adm = ctx.admission
        for source in (adm.admitted, adm.pending):
            w = source.get(job_id)
            if w is not None:
                spec: JobSpec = w.spec
                return spec
        return None


def _requests(ctx: PreemptionContext) -> list[tuple[str, str, dict[str, int], dict[str, int], int | None]]:
    """A pass's requests in order: (preemptor, reason, need, own_need, max victim priority). The unplaceable jobs
    that ask for preemption (room on the nodes), then admission's (quota: reclaims, and within-queue
    preemptions with reason PriorityPreemption)."""
    requests: list[tuple[str, str, dict[str, int], dict[str, int], int | None]] = [
        (u.job_id, PRIORITY, {}, {}, None) for u in ctx.unplaceable]
    for r in ctx.reclaims:
        requests.append((r.preemptor, RECLAIM if r.reason == RECLAIM else PRIORITY, dict(r.need),
                         dict(getattr(r, "own_need", {})), getattr(r, "max_victim_priority", None)))
    return requests
