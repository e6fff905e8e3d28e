"""The discrete-event engine: virtual time, one event heap, and a policy that decides.

Events are arrivals, completions, wake-ups (ticks a policy asks for) and, when asked, node failures and
repairs (sim/failures.py). All events of one instant are
applied first, then the policy runs ONE cycle for that instant (batch scheduling: a cycle per instant in
which something changed, never one per job). The engine alone knows true durations; it schedules a
completion when the policy reports a start and cancels it (lazily, by epoch) when a job is preempted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# A victim of preemption: the type the decision loop returns (services/core/pipeline: the ETA replay uses it too).
from services.core.pipeline import Preempted
from sim.failures import NodeFailure, lost_work_s
from sim.model import Trace, TraceJob, goodput

# Causes of lost work the metrics report (`lost_gpu_hours_by_cause`); node failures are counted apart
# (`JobRecord.failure_lost_gpu_s`).
LOSS_CAUSES = ("reclaim", "priority", "defragmentation", "other")


def loss_cause(reason: str) -> str:
    """The cause a preemption's reason stands for: a reclaim of lent quota, a higher priority (within a queue or
    asked by the scheduler), a defragmentation move, or anything else a baseline reports."""
    if reason == "ReclaimQuota":
        return "reclaim"
    if reason == "PriorityPreemption":
        return "priority"
    if reason.startswith("Defragment"):
        return "defragmentation"
    return "other"


# Event kinds; at equal times completions are applied before arrivals so freed GPUs are visible to the
# cycle of that instant either way (all events of an instant precede its cycle).
# A node that comes back is usable by that instant's cycle; a node that fails kills its jobs before it.
COMPLETION, NODE_UP, NODE_DOWN, ARRIVAL, TICK = 0, 1, 2, 3, 4


@dataclass
class CycleOutput:
    started: list[str] = field(default_factory=list)  # job ids whose whole gang now runs
    preempted: list[Preempted] = field(default_factory=list)  # running jobs stopped (they go back to pending)
    rejected: dict[str, str] = field(default_factory=dict)  # job id -> reason (never admissible)
    wake_at: float | None = None  # ask for a cycle at this virtual time even if nothing else happens
    # elastic jobs (sim/model.py `goodput`): job id -> (pods, of its most pods) for a start with fewer pods than
    # its most and for every running job resized by the cycle; absent: the whole gang
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)


class Policy(Protocol):
    name: str

    def setup(self, trace: Trace) -> None: ...
    def on_arrival(self, job: TraceJob, now: float) -> str | None: ...  # a rejection reason, or None
    def on_completion(self, job_id: str, now: float) -> None: ...
    def cycle(self, now: float) -> CycleOutput: ...
    def allocated_milli(self) -> int: ...  # milli-GPUs held now, including partly placed gangs
    def fragmentation(self) -> int: ...  # free GPUs that no waiting gang can use, now
    # A node failed: stop every job with a pod on it, take them back to waiting, and keep the node out of use;
    # returns the running jobs it stopped. A node came back: use it again.
    def on_node_down(self, node: str, now: float) -> list[str]: ...
    def on_node_up(self, node: str, now: float) -> None: ...


@dataclass
class JobRecord:
    job: TraceJob
    start: float | None = None  # first start
    end: float | None = None
    rejected: str | None = None
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    remaining: float = 0.0  # true work left, seconds
    last_start: float | None = None
    node_failures: int = 0  # times a node failure stopped it
    failure_lost_gpu_s: float = 0.0  # GPU-seconds of work lost to node failures
    # GPU-seconds lost to preemption per cause (`loss_cause` of the victim's reason): reclaim, priority, other
    lost_by_cause: dict[str, float] = field(default_factory=dict)


@dataclass
class Sample:
    t: float
    allocated_milli: int
    busy_milli: int
    pending: int
    running: int


@dataclass
class SimResult:
    policy: str
    trace: Trace
    records: dict[str, JobRecord]
    samples: list[Sample]  # after every cycle: a step function of allocation over time
    fragmentation: list[tuple[float, int]]  # sampled every `frag_every_s` of virtual time
    events: int
    cycles: int
    end_time: float
    node_failures: int = 0


@dataclass
class Engine:
    trace: Trace
    policy: Policy
    frag_every_s: float = 3_600.0
    progress: Callable[[int], None] | None = None  # called with the number of jobs finished so far
    failures: Sequence[NodeFailure] = ()

    def run(self) -> SimResult:
        trace, policy = self.trace, self.policy
        policy.setup(trace)
        replay = _Replay(trace, policy, self.failures)
        samples: list[Sample] = []
        frag: list[tuple[float, int]] = []
        next_frag = 0.0
        heap = replay.heap
        while heap:
            if replay.finished == replay.total and heap[0][1] in (NODE_DOWN, NODE_UP):
                break  # failures after the last job ended change nothing and must not stretch the makespan
            now = replay.now = heap[0][0]
            # 1. apply every event of this instant
            while heap and heap[0][0] == now:
                _, kind, _, job_id, ep = heapq.heappop(heap)
                replay.apply(kind, job_id, ep)
            # 2. one cycle for the instant
            replay.apply_cycle(policy.cycle(now))
            samples.append(Sample(now, policy.allocated_milli(), replay.busy, replay.pending, len(replay.running)))
            if now >= next_frag:
                frag.append((now, policy.fragmentation()))
                next_frag = now + self.frag_every_s
            if self.progress is not None:
                self.progress(replay.finished)
        return SimResult(policy=policy.name, trace=trace, records=replay.records, samples=samples,
                         fragmentation=frag, events=replay.events, cycles=replay.cycles, end_time=replay.now,
                         node_failures=replay.failures)


class _Replay:
    """The engine's state while it replays: the event heap, the jobs' records, what runs, the counters. `apply`
    takes one event, `apply_cycle` what the policy decided for the instant."""

    def __init__(self, trace: Trace, policy: Policy, failures: Sequence[NodeFailure]) -> None:
        self.trace, self.policy = trace, policy
        self.records = {j.job_id: JobRecord(job=j, remaining=float(j.duration)) for j in trace.jobs}
        self.epoch = dict.fromkeys(self.records, 0)  # completion events carry the epoch; a preemption bumps it
        self.heap: list[tuple[float, int, int, str, int]] = []  # (time, kind, seq, job_id, epoch)
        seq = 0
        for j in trace.jobs:
            self.heap.append((float(j.submit_time), ARRIVAL, seq, j.job_id, 0))
            seq += 1
        for f in failures:
            self.heap.append((float(f.down_at), NODE_DOWN, seq, f.node, 0))
            self.heap.append((float(f.up_at), NODE_UP, seq + 1, f.node, 0))
            seq += 2
        heapq.heapify(self.heap)
        self.seq = seq
        self.notices = {(f.down_at, f.node): f for f in failures if f.notice_s}  # spot interruptions
        self.running: dict[str, float] = {}  # job_id -> milli-GPUs of a running gang
        self.rate: dict[str, float] = {}  # running elastic job -> its goodput now (1.0, the whole gang: absent)
        self.busy = self.pending = self.events = self.cycles = self.finished = self.failures = 0
        self.now = 0.0
        self.wake_times: set[float] = set()
        self.total = len(self.records)

    def push(self, at: float, kind: int, job_id: str, epoch: int) -> None:
        heapq.heappush(self.heap, (at, kind, self.seq, job_id, epoch))
        self.seq += 1

    def stop(self, job_id: str) -> tuple[JobRecord, float, float, float] | None:
        """Take a running job off its GPUs and back to waiting (its scheduled completion goes stale): its record,
        the seconds it ran since its last start (or resize), its milli-GPUs and its goodput meanwhile; None if it
        was not running."""
        milli = self.running.pop(job_id, None)
        if milli is None:
            return None
        self.busy -= int(milli)
        self.pending += 1
        self.epoch[job_id] += 1
        rec = self.records[job_id]
        return rec, self.now - (self.now if rec.last_start is None else rec.last_start), milli, \
            self.rate.pop(job_id, 1.0)

    def resize(self, job_id: str, pods: int, of: int, *, started: bool) -> None:
        """An elastic job runs `pods` of its most `of` pods from now: its work so far at the old goodput is done,
        the rest goes at the new one (its completion moves), and it holds that share of its GPUs."""
        rec, now = self.records[job_id], self.now
        if not started:
            rec.remaining -= (now - (now if rec.last_start is None else rec.last_start)) * self.rate.get(job_id, 1.0)
            self.epoch[job_id] += 1
        rec.last_start = now
        rate = goodput(rec.job, pods, of)
        self.rate[job_id] = rate
        milli = self.trace.gpu_milli(rec.job) * pods / of
        self.busy += int(milli) - int(self.running[job_id])
        self.running[job_id] = milli
        self.push(now + max(0.0, rec.remaining) / rate, COMPLETION, job_id, self.epoch[job_id])

    def apply(self, kind: int, job_id: str, ep: int) -> None:
        """One event of the instant `now`: a completion (unless stale), a node failing or coming back, an arrival,
        a wake-up."""
        now, records = self.now, self.records
        if kind == COMPLETION:
            if ep != self.epoch[job_id] or job_id not in self.running:
                return  # stale: the job was preempted after this completion was scheduled
            self.events += 1
            self.busy -= int(self.running.pop(job_id))
            self.rate.pop(job_id, None)
            rec = records[job_id]
            rec.end, rec.remaining = now, 0.0
            self.policy.on_completion(job_id, now)
            self.finished += 1
        elif kind == NODE_DOWN:
            self.events += 1
            self.failures += 1
            for killed in self.policy.on_node_down(job_id, now):
                stopped = self.stop(killed)
                if stopped is None:
                    continue
                rec, ran, milli, rate = stopped
                lost = lost_work_s(ran, rec.job.checkpoint_interval_s, self.notices.get((int(now), job_id)))
                rec.remaining = max(1.0, rec.remaining - (ran - lost) * rate)
                rec.node_failures += 1
                rec.failure_lost_gpu_s += lost * milli / 1000
        elif kind == NODE_UP:
            self.events += 1
            self.policy.on_node_up(job_id, now)
        elif kind == ARRIVAL:
            self.events += 1
            reason = self.policy.on_arrival(records[job_id].job, now)
            if reason is not None:
                records[job_id].rejected = reason
                self.finished += 1
            else:
                self.pending += 1
        else:
            self.events += 1
            self.wake_times.discard(now)

    def apply_cycle(self, out: CycleOutput) -> None:
        """What the policy's cycle at `now` decided: preemptions (work lost since the last checkpoint, per cause),
        rejections, starts (their completions scheduled), and when to wake it again."""
        now, records = self.now, self.records
        self.cycles += 1
        for p in out.preempted:
            stopped = self.stop(p.job_id)
            if stopped is None:
                continue
            rec, ran, milli, rate = stopped
            gpus = milli / 1000
            lost_s = min(ran, p.lost_gpu_s / gpus) if gpus else 0.0
            rec.remaining = max(1.0, rec.remaining - (ran - lost_s) * rate)
            rec.preemptions += 1
            rec.lost_gpu_s += p.lost_gpu_s
            cause = loss_cause(p.reason)
            rec.lost_by_cause[cause] = rec.lost_by_cause.get(cause, 0.0) + p.lost_gpu_s
        for job_id, reason in out.rejected.items():
            records[job_id].rejected = reason
            self.pending -= 1
            self.finished += 1
        for job_id in out.started:
            rec = records[job_id]
            if rec.start is None:
                rec.start = now
            rec.last_start = now
            milli = self.trace.gpu_milli(rec.job)
            self.running[job_id] = milli
            self.busy += milli
            self.pending -= 1
            if job_id in out.sizes:
                self.resize(job_id, *out.sizes[job_id], started=True)
            else:
                self.push(now + rec.remaining, COMPLETION, job_id, self.epoch[job_id])
        for job_id, (pods, of) in sorted(out.sizes.items()):
            if job_id not in out.started and job_id in self.running:
                self.resize(job_id, pods, of, started=False)
        if out.wake_at is not None and out.wake_at > now and out.wake_at not in self.wake_times:
            self.wake_times.add(out.wake_at)
            self.push(out.wake_at, TICK, "", 0)
