"""Expected start times (ETA): forward simulation with the production pipeline core, predicted durations, a
calibrated range. The admission service and the simulator run this same code.

`estimate_starts` copies the admission and cluster snapshots, then replays the future the platform expects:
running jobs end at their predicted end, and after each end the pipeline's decision loop
(`services.core.pipeline.decide`: admission, placement in the pipeline's order, preemption) runs as in production. The
scheduler inside the replay still believes what the real one believes (reservations from `max_runtime_s`), so
it decides as the real one will; only time advances by the predictions. The replay also preempts as the platform
does (`ReplayPreemption`: the decision loop's preemption stage, `services.core.pipeline.decide`: admission's
reclaims and the unplaceable jobs' requests, the production preemption core's victims, protection windows and
cool-downs), so a job waiting behind a lower-priority job's quota is shown
the end of that job's protection, not of its run. Nothing new arrives in the replay;
`estimate_ranges` then moves each start later by what the higher-priority arrivals expected from the queue's
recent history would take (`ArrivalHistory`).

`estimate_ranges` is what users see: the most likely start from predicted durations
(`services.core.pipeline.predict`) and expected arrivals, and a p10-p90 range from two more replays with every
duration at its own p10 and p90, widened or narrowed by the per-queue record of ETAs given against actual starts
(`EtaCalibration`, conformal).

Pure: no I/O, no clock, the states passed in are never mutated (`EtaModel` is the caller's memory, changed only
through its methods).
"""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.core.pipeline.loop import PreemptionStage, ReplayAsks
from services.core.pipeline.predict import (
    DEFAULT_WINDOW,
    HIGH_Q,
    LOW_Q,
    DurationPredictor,
    JobKey,
    Prediction,
)
from services.core.pipeline.preempt import VictimChooser
from shared.domain import MILLI_GPU, JobSpec, mig_milli_gpus

# How far ahead a replay looks. An ETA assumes nothing new arrives; a week ahead that assumption says nothing (a
# week of arrivals reorders any queue), so a job the replay does not start within it is reported as beyond the
# horizon (no ETA) rather than given a date. Also bounds the replay of a job that can never start.
DEFAULT_HORIZON_S = 7 * 86_400.0
# Ends closer together than this fraction of the look-ahead are replayed as one (the cycle runs at the latest of
# them): a planned start moves later by at most this fraction of its wait, far inside the ±20% users are promised,
# and a replay runs O(log(horizon) / RESOLUTION) cycles however many jobs hold GPUs.
RESOLUTION = 0.02
IDLE_REFRESH_S = RESOLUTION * DEFAULT_HORIZON_S  # time-only refreshes while no waiting job starts within it
MIN_REMAINING_S = 60.0  # an overrunning job (past its estimate) is assumed to end this soon
MIN_WAIT_S = 60.0  # waits are compared as ratios; below a minute the ratio says nothing
ALL_QUEUES = "*"  # the calibration record of every queue together (the fallback of a queue without one)
ETA_REFRESH_S = 300.0  # platform seconds between ETA refreshes when nothing changed
ETA_MIN_REFRESH_S = 30.0  # platform seconds at least between two refreshes: a burst of changes is one refresh
# The arrival history's bound per queue (ArrivalHistory): its look-back never exceeds the horizon, and a queue
# receiving more than this many jobs within a horizon has its rate measured over the span these cover.
ARRIVAL_HISTORY = 10_000
# The work budget of one replay (`estimate_starts`), in job-cycles: each pipeline cycle of the replay costs the
# jobs it looks at (waiting and holding GPUs), and the replay stops once it has spent the budget. The exact replay
# takes the first budget // HEAD_CYCLES waiting jobs in the platform's order (the head of the queue); every job
# after them, and any the exact replay had not started when the budget ran out, gets a coarse start
# (`_StartsReplay.coarse`: list scheduling by GPU count on each model's GPUs as the jobs holding them end, no
# quota or topology) and a range wider by TAIL_WIDEN on each side.
# A refresh therefore costs about the same whatever the queue's depth beyond the head, plus one pass over the
# tail up to the horizon (`gpuq bench eta`: 20,000 waiting on 1,280 GPUs). Not tuned to a trace: the budget is a
# cost. `estimate_ranges` spends DEFAULT_BUDGET per refresh, all three replays together (`estimate_ranges`).
DEFAULT_BUDGET = 60_000
HEAD_CYCLES = 60
TAIL_WIDEN = 1.5  # a coarse start's range: its wait divided by this at the low end, multiplied at the high end
# How an ETA's p10-p90 range is made (`EtaModel.range_method`): "replays", two more replays with every duration at
# its p10 and p90, widened by the record's conformal margin (`EtaCalibration.calibrated`); "calibrated", the
# median replay alone, its wait scaled by the quantiles of the errors the record saw (`calibrated_range`), a third
# of the replays' work. RANGE_METHODS[0] is the default.
RANGE_METHODS = ("replays", "calibrated")
# The calibrated range's cold start, before any record has `min_samples` entries: the wait divided by this at the
# low end and multiplied at the high end (a start from a quarter to four times the planned wait). A stated prior,
# not fitted to a trace: wider than any warm range the tests' records give, and than a coarse start's TAIL_WIDEN².
COLD_WIDEN = 4.0

Duration = Callable[[JobSpec], float]


def estimate_starts(cluster: Any, admission: Any, running: Mapping[str, float], now: float, *,
                    horizon_s: float = DEFAULT_HORIZON_S, max_cycles: int = 10_000,
                    backfill: bool = True, duration: Duration | None = None,
                    believed_ends: Mapping[str, float] | None = None,
                    resolution: float = RESOLUTION,
                    started: Mapping[str, float] | None = None,
                    preempted_at: Mapping[str, float] | None = None,
                    budget: int | None = None) -> dict[str, float]:
    """{job_id: planned start (same clock as `now`, e.g. epoch seconds)} for every admitted-but-unplaced and
    pending job that would start within `horizon_s`; jobs that would not are left out (beyond the horizon).

    cluster:   services.core.scheduler.ClusterState (running jobs' allocations committed)
    admission: services.core.admission.AdmissionState (pending + admitted workloads)
    running:   job_id -> when each job holding GPUs is expected to end (predicted, or started_at + limit)
    duration:  how long a job that starts in the replay runs (default: its `max_runtime_s`)
    believed_ends: job_id -> the end the scheduler reserves by (started_at + max_runtime_s; default `running`)
    resolution: ends within this fraction of the look-ahead of the first one are replayed together (0: each)
    started:   job_id -> when each running job whose spec `admission` holds started: given, the replay also
               preempts as the platform does (`ReplayPreemption`: admission's reclaims and within-queue priority
               preemptions, decided by the production preemption core with its protection window and guard
               rails); a victim waits again with the run time it had left. None: nothing is preempted.
    preempted_at: job_id -> when each waiting job was last preempted (its cool-down as a preemptor runs from
               then, as the preemption service's does)
    budget:    the replay's work in job-cycles (DEFAULT_BUDGET); None: the whole queue replayed exactly, however
               long that takes. With a budget, the far tail of the queue gets coarse starts (`plan_starts`).
    """
    return plan_starts(cluster, admission, running, now, horizon_s=horizon_s, max_cycles=max_cycles,
                       backfill=backfill, duration=duration, believed_ends=believed_ends, resolution=resolution,
                       started=started, preempted_at=preempted_at, budget=budget)[0]


def plan_starts(cluster: Any, admission: Any, running: Mapping[str, float], now: float, *,
                horizon_s: float = DEFAULT_HORIZON_S, max_cycles: int = 10_000,
                backfill: bool = True, duration: Duration | None = None,
                believed_ends: Mapping[str, float] | None = None,
                resolution: float = RESOLUTION,
                started: Mapping[str, float] | None = None,
                preempted_at: Mapping[str, float] | None = None,
                budget: int | None = None, tail: Sequence[TailJob] | None = None
                ) -> tuple[dict[str, float], frozenset[str]]:
    """`estimate_starts`, and which of the starts are coarse (the tail beyond the budget's exact replay).
    `tail`: `admission` is already cut to the head of the queue and these are the rest (`cut_queue`, done once
    for several replays); None: cut here when there is a budget."""
    starts, coarse, _spent = _plan(cluster, admission, running, now, horizon_s=horizon_s, max_cycles=max_cycles,
                                   backfill=backfill, duration=duration, believed_ends=believed_ends,
                                   resolution=resolution, started=started, preempted_at=preempted_at,
                                   budget=budget, tail=tail)
    return starts, coarse


def _plan(cluster: Any, admission: Any, running: Mapping[str, float], now: float, *, horizon_s: float,
          max_cycles: int, backfill: bool, duration: Duration | None, believed_ends: Mapping[str, float] | None,
          resolution: float, started: Mapping[str, float] | None, preempted_at: Mapping[str, float] | None,
          budget: int | None, tail: Sequence[TailJob] | None) -> tuple[dict[str, float], frozenset[str], int]:
    """`plan_starts`, and the job-cycles the exact replay spent."""
    if budget is not None and budget < 1:
        raise ValueError(f"need budget >= 1 (or None), got {budget}")
    if horizon_s <= 0 or not 0.0 <= resolution < 1.0:
        raise ValueError(f"need horizon_s > 0 and 0 <= resolution < 1, got {horizon_s}, {resolution}")
    # (imported when called: the pipeline core is imported late, and tests count its passes through the module)
    from services.core.pipeline import decide

    if budget is not None and tail is None:
        admission, tail = cut_queue(cluster, admission, running, budget)
    replay = _StartsReplay(cluster, admission, running, now, decide=decide, backfill=backfill,
                           run_for=duration or (lambda spec: float(spec.max_runtime_s)),
                           believed_ends=believed_ends, started=started, preempted_at=preempted_at,
                           tail=tail or ())
    replay.budget = budget
    return _run(replay, horizon_s=horizon_s, max_cycles=max_cycles, resolution=resolution, budget=budget)


def _run(replay: _StartsReplay, *, horizon_s: float, max_cycles: int, resolution: float, budget: int | None,
         settled: bool = False) -> tuple[dict[str, float], frozenset[str], int]:
    """A replay from its first instant to its end (`_plan`); `settled`: the first instant was decided already
    (`_StartsReplay.fork`)."""
    t = replay.now
    spent_all = False
    for _ in range(max_cycles):
        if replay.anything_waiting() and not settled:
            replay.settle(t)
        settled = False
        if not replay.anything_waiting():
            break
        if budget is not None and replay.spent >= budget:
            spent_all = True
            break
        step = replay.next_step(t, horizon_s, resolution)
        if step is None:
            break
        t = step
    coarse = replay.coarse(t, horizon_s, everything_left=spent_all) if replay.tail or spent_all else frozenset()
    return dict(sorted(replay.starts.items())), coarse, replay.spent


class TailJob:
    """A waiting job beyond the head of the queue (`cut_queue`): replayed coarsely, by its GPU count. (A slotted
    class, not a dataclass: a deep tail makes tens of thousands per refresh.)"""

    __slots__ = ("allowed", "job_id", "spec")

    def __init__(self, job_id: str, spec: JobSpec, allowed: tuple[str, ...] | None = None):
        self.job_id = job_id
        self.spec = spec
        self.allowed = allowed  # the GPU models it accepts, when not its spec's (the scheduler's view)

    @classmethod
    def of(cls, spec: JobSpec, models: tuple[str, ...] | None = None) -> TailJob:
        return cls(spec.job_id, spec, models)

    # (computed when a coarse replay reaches the job: a deep tail's far end lies beyond the horizon and is never
    # reached)
    @property
    def gpus(self) -> float:
        """Whole GPUs it needs at once (MIG slices rounded up to a GPU)."""
        return max(1.0, float(math.ceil(gpu_share(self.spec))))

    @property
    def models(self) -> tuple[str, ...]:
        """The GPU models it accepts (empty: any)."""
        return self.spec.gpu_models if self.allowed is None else self.allowed


def cut_queue(cluster: Any, admission: Any, running: Collection[str], budget: int
              ) -> tuple[Any, list[TailJob]]:
    """(a copy of `admission` holding only the head of the queue, the rest in order) for a replay of `budget`
    job-cycles: the head is the first budget // HEAD_CYCLES waiting jobs, every admitted one (the scheduler's
    list) then the pending ones in the platform's order (priority, then order time, then id, across queues).
    With no more waiting than that, `admission` itself and no tail. Never changes `admission`."""
    head = max(1, budget // HEAD_CYCLES)
    placed = cluster.allocations()
    keep = head - sum(1 for j in admission.admitted if j not in placed and j not in running)
    if len(admission.pending) <= keep:
        return admission, []
    adm = admission.copy()
    order = heapq.merge(*(lst for _q, lst in sorted(adm.ordered_pending().items())), key=lambda e: e.order)
    pending = adm.pending
    tail = [TailJob(e.job_id, pending[e.job_id].spec) for e in itertools.islice(order, max(0, keep), None)]
    for t in tail:
        adm.finish(t.job_id)
    return adm, tail


class _StartsReplay:
    """The memory of one `estimate_starts` replay on its own copies of the snapshots: the scheduler's view of the
    running jobs, the waiting jobs, the ends to come, the replay's preemptions and the starts planned so far.
    Split in two steps, what happens at one instant (`settle`) and where the replay goes next (`next_step`)."""

    def __init__(self, cluster: Any, admission: Any, running: Mapping[str, float], now: float, *,
                 decide: Callable[..., Any], backfill: bool, run_for: Duration,
                 believed_ends: Mapping[str, float] | None, started: Mapping[str, float] | None,
                 preempted_at: Mapping[str, float] | None, tail: Sequence[TailJob] = ()):
        from services.core.pipeline import waiting_job
        from services.core.scheduler import Hold, RunningJob

        self._decide = decide
        self._running_job = RunningJob
        self._hold = Hold
        self.backfill = backfill
        self.run_for = run_for
        self.now = now
        self.running = running
        self.cl = cluster.copy()
        self.adm = admission.copy()
        placed_now = set(self.cl.allocations())
        self.ends: list[tuple[float, str]] = sorted((_end_from(end, now), job_id) for job_id, end in running.items())
        heapq.heapify(self.ends)
        # The scheduler's running list, one RunningJob per job (made once: this loop runs hundreds of cycles).
        self.believed = {j: RunningJob(job_id=j, expected_end=e)
                         for j, e in (believed_ends.items() if believed_ends is not None
                                      else ((j, e) for e, j in self.ends))}
        # Admitted but not yet placed: the scheduler's pending list (the pipeline orders it).
        self.waiting = {job_id: waiting_job(self.adm.config, a) for job_id, a in sorted(self.adm.admitted.items())
                        if job_id not in placed_now and job_id not in running}
        self.starts: dict[str, float] = {}
        # each running job's end (a preempted one's entry goes stale)
        self.current = {job_id: end for end, job_id in self.ends}
        self.preempt = (ReplayPreemption(self.adm, started, preempted_at or {}) if started is not None else None)
        self.left_s: dict[str, float] = {}  # a job preempted in the replay -> the run time it had left
        # a victim of the replay -> its capacity, held for its preemptor as the scheduler holds it
        # (docs/preemption.md)
        self.holds: dict[str, Any] = {}
        self.spent = 0  # job-cycles so far (the budget's unit)
        self.budget: int | None = None  # (the replay's budget: a pass of `settle` stops its rounds once spent)
        # the pending jobs beyond the head, in the platform's order, left out of the exact replay (`cut_queue`)
        self.tail: Sequence[TailJob] = tail
        # While not None: what the first instant started (job id, spec) and preempted (job id, None), in order,
        # for `fork`; `checked` / `broke`: the job-cycles spent when `settle` last checked the budget, and
        # whether the budget stopped it
        self.log: list[tuple[str, JobSpec | None]] | None = None
        self.checked = 0
        self.broke = False

    def anything_waiting(self) -> bool:
        return bool(self.waiting or self.adm.pending)

    def settle(self, t: float) -> None:
        """A pass of the decision loop (`decide`: admission, placement, and the victims of the jobs it found
        unplaceable and of admission's reclaims), then, when it preempted, a pass again in the same instant (the
        victims' GPUs are free at once, as in the simulator's policy), until a pass preempts nothing. Each round
        takes a victim or stops, so there are at most as many rounds as jobs hold GPUs."""
        preempt = self.preempt
        for _round in range(len(self.current) + 1):
            self.spent += len(self.waiting) + len(self.adm.pending) + len(self.believed)
            # (schedule_cycle orders the running list itself)
            # (preemption: admission's reclaims, and the scheduler's asks: an admitted job that cannot be placed
            # asks for a lower-priority job's GPUs, which the platform takes when that job's protection ends)
            out = self._decide(self.adm, self.cl, self.waiting, list(self.believed.values()), t, stage=preempt,
                               backfill=self.backfill, run_admission=bool(self.adm.pending),
                               holds=tuple(h for h in self.holds.values() if h.until > t))
            self._take(out, t)
            if not out.preemptions:
                break
            self._requeue({v.job_id: v.preemptor for v in out.preemptions}, t)
            self.checked = self.spent
            if self.budget is not None and self.spent >= self.budget:
                self.broke = True
                break  # (the budget is spent: what waits gets a coarse start, `coarse`)

    def shares_first_instant(self, budget: int | None) -> bool:
        """Whether a replay of the same queue with `budget` decides its first instant as this one did: this one's
        `settle` was not stopped by its budget, and `budget` would not have stopped it either."""
        return not self.broke and (budget is None or self.checked < budget)

    def fork(self, running: Mapping[str, float], run_for: Duration) -> _StartsReplay:
        """After the first instant's `settle` (with `log` on): the replay the same queue would be after its first
        instant if its running jobs ended at `running` and the jobs it starts ran `run_for`. The first instant's
        decisions read neither (admission, the scheduler and preemption see the reserved ends, `believed`), so
        only the ends to come differ: they are rebuilt from the log, stale heap entries included (`next_step`
        steps to the latest end it pops, a preempted job's old one too), and the result equals that replay's
        to the last bit (tests/unit/sim/test_eta_shared_instant.py). The three replays of a refresh share their
        first instant this way (`estimate_ranges`): at depth it is most of a replay's work (its preemption
        rounds)."""
        if self.log is None:
            raise ValueError("fork needs the first instant's log (replay.log = [] before settle)")
        other = copy.copy(self)
        other.running, other.run_for = running, run_for
        other.cl, other.adm = self.cl.copy(), self.adm.copy()
        other.waiting, other.believed = dict(self.waiting), dict(self.believed)
        other.starts, other.holds = dict(self.starts), dict(self.holds)
        other.tail, other.log = (), None
        if self.preempt is not None:
            # (frozen specs and the configuration are shared; the preemption core's memory is copied whole)
            memo: dict[int, Any] = {id(self.preempt.config): self.preempt.config}
            for info in self.preempt.running.values():  # (frozen: RunningInfo and its spec)
                memo[id(info)], memo[id(info.spec)] = info, info.spec
            other.preempt = copy.deepcopy(self.preempt, memo)
        now = self.now
        current = {job_id: _end_from(end, now) for job_id, end in running.items()}
        ends = [(end, job_id) for job_id, end in current.items()]
        left: dict[str, float] = {}
        for job_id, spec in self.log:
            if spec is None:  # preempted (`_requeue`)
                left[job_id] = max(1.0, current.pop(job_id) - now)
            else:  # started (`_take`)
                end = now + max(1.0, left.pop(job_id) if job_id in left else run_for(spec))
                current[job_id] = end
                ends.append((end, job_id))
        heapq.heapify(ends)
        other.current, other.ends, other.left_s = current, ends, left
        return other

    def _take(self, out: Any, t: float) -> None:
        """A cycle's admissions join the waiting jobs; its placements start, each with its end to come."""
        for w in out.admitted:
            self.waiting[w.job_id] = w
        if self.holds and out.placement.result.placed:
            placed = {p.job_id for p in out.placement.result.placed}
            self.holds = {v: h for v, h in self.holds.items() if h.preemptor not in placed and h.until > t}
        for p in out.placement.result.placed:
            w = self.waiting.pop(p.job_id)
            if self.log is not None:
                self.log.append((p.job_id, w.spec))
            if p.job_id not in self.running:  # (a running job preempted in the replay and restarted: no ETA)
                self.starts.setdefault(p.job_id, t)  # a job preempted in the replay keeps its first start
            self.believed[p.job_id] = self._running_job(job_id=p.job_id, expected_end=t + w.spec.max_runtime_s)
            end = t + max(1.0, self.left_s.pop(p.job_id) if p.job_id in self.left_s else self.run_for(w.spec))
            self.current[p.job_id] = end
            heapq.heappush(self.ends, (end, p.job_id))

    def _requeue(self, preemptors: Mapping[str, str | None], t: float) -> None:
        """The replay's victims (-> their preemptors) go back to admission; their GPUs are free now: admit and
        place again."""
        from services.core.admission import Workload
        from services.core.pipeline import hold_until

        for v in sorted(preemptors):
            if self.log is not None:
                self.log.append((v, None))
            preemptor, placement = preemptors[v], self.cl.placement_of(v)
            if preemptor is not None and placement is not None:
                self.holds[v] = self._hold(preemptor=preemptor, victim=v, placement=placement,
                                           until=hold_until(t, self.adm.config.policy.checkpoint_grace_s))
            self.left_s[v] = max(1.0, self.current.pop(v) - t)
            self.believed.pop(v, None)
            self.cl.release(v)
            held = self.adm.admitted[v]
            self.adm.requeue(Workload(spec=held.spec, submitted_at=held.submitted_at))

    def coarse(self, t: float, horizon_s: float, everything_left: bool) -> frozenset[str]:
        """Coarse starts, from `t` on, for the tail (and, `everything_left`, for the jobs the exact replay had not
        started when its budget ran out: first the admitted ones in placement order, then the pending ones in the
        platform's order): list scheduling on each GPU model's count, FIFO, as the jobs holding GPUs at `t` end
        and the tail's own jobs end after running `run_for`; a job accepting several models goes where it starts
        first; no quota, topology or fragmentation. One pass: O(tail log running). Returns the jobs given one."""
        from services.core.pipeline import placement_key

        left: list[TailJob] = []
        if everything_left:
            left += [TailJob.of(w.spec, w.allowed_models) for w in sorted(self.waiting.values(), key=placement_key)]
            order = heapq.merge(*(lst for _q, lst in sorted(self.adm.ordered_pending().items())),
                                key=lambda e: e.order)
            left += [TailJob.of(self.adm.pending[e.job_id].spec) for e in order]
        left += self.tail
        total = self.cl.total_gpus_by_model()
        free = {m: float(n) for m, n in self.cl.free_gpus_by_model().items()}
        clock = dict.fromkeys(total, t)
        ends: dict[str, list[tuple[float, float]]] = {m: [] for m in total}
        for job_id, end in sorted(self.current.items()):
            placement = self.cl.placement_of(job_id)
            if placement is not None and placement.bindings:
                model = self.cl.node(placement.bindings[0].node).gpu_model
                ends.setdefault(model, []).append((end, float(placement.gpus)))
        for heap in ends.values():
            heapq.heapify(heap)
        last = self.now + horizon_s
        given: set[str] = set()
        by_name = sorted(total)
        for job in left:
            need, models = job.gpus, job.models
            best: tuple[float, str] | None = None
            for m in by_name:
                if (models and m not in models) or total[m] < need:
                    continue
                heap = ends[m]
                at = clock[m] if free[m] >= need else (max(clock[m], heap[0][0]) if heap else math.inf)
                if best is None or at < best[0]:
                    best = (at, m)
            if best is None:
                continue  # no model of the cluster can ever hold it: no ETA
            m = best[1]
            heap = ends[m]
            while free[m] < need and heap:
                end, gpus = heapq.heappop(heap)
                clock[m], free[m] = max(clock[m], end), free[m] + gpus
            if free[m] < need or clock[m] > last:
                if min(clock.values()) > last:
                    break  # (clocks only move on: every job left starts beyond the horizon)
                continue  # beyond the horizon
            free[m] -= need
            heapq.heappush(heap, (clock[m] + max(1.0, self.run_for(job.spec)), need))
            if job.job_id not in self.running:  # (a running job preempted in the replay: no ETA, as in `_take`)
                self.starts.setdefault(job.job_id, clock[m])
                given.add(job.job_id)
        return frozenset(given)

    def next_step(self, t: float, horizon_s: float, resolution: float) -> float | None:
        """The next instant the replay decides at (the jobs ending by then have ended), or None: nothing
        happens within the horizon."""
        ends, preempt = self.ends, self.preempt
        while ends and self.current.get(ends[0][1]) != ends[0][0]:
            heapq.heappop(ends)  # a preempted job's old end
        wake = preempt.wake_at(t) if preempt is not None else None
        first = min(ends[0][0] if ends else math.inf, wake if wake is not None else math.inf)
        if first > self.now + horizon_s:
            return None
        if wake is not None and wake < (ends[0][0] if ends else math.inf):
            return wake  # a protection window ends before any job: the preemptions it allows are decided then
        # Every job ending at this instant or within `resolution` of the look-ahead after it, then one cycle at
        # the latest of those ends (never before a job's end: a start is planned late by at most that fraction).
        until = min(self.now + horizon_s, ends[0][0] + resolution * (ends[0][0] - self.now))
        if wake is not None:
            until = min(until, wake)
        while ends and ends[0][0] <= until:
            t, job_id = heapq.heappop(ends)
            if self.current.get(job_id) != t:
                continue
            del self.current[job_id]
            self.believed.pop(job_id, None)
            self.cl.release(job_id)
            self.adm.finish(job_id)
            if preempt is not None:
                preempt.ended(job_id)
        return t


def _end_from(end: float, now: float) -> float:
    """A running job's end as the replay takes it: an overrunning one (past its expected end) ends soon."""
    return max(end, now + MIN_REMAINING_S if end <= now else end)


class ReplayPreemption(PreemptionStage):
    """Preemption inside a replay, as the platform would preempt: the decision loop's preemption stage
    (services/core/pipeline/loop.py) with the production victim chooser (`VictimChooser`: victims chosen by
    `select_victims`, never a production or non-preemptible job nor one inside its protection window, with the
    per-queue hourly limit and the cool-down) and `ReplayAsks`: a request is asked once, and again only after a
    protection window or a preemptor's cool-down that held one back ends, when the replay wakes
    (`wake_at`). Without it a job that waits for a lower-priority job's quota is shown the end of that job,
    where the platform starts it when the job's protection ends. Replay-only memory: what the real preemption
    service did before `now` (its hourly counts, the requests it already refused) is not known here and starts
    empty; the waiting jobs' last preemptions are (`preempted_at`: their cool-downs as preemptors)."""

    def __init__(self, admission: Any, started: Mapping[str, float], preempted_at: Mapping[str, float]):
        self.replay_asks = ReplayAsks()
        super().__init__(VictimChooser(admission.config, checkpointing=True), self.replay_asks)
        self.chooser.last_preempted.update(preempted_at)  # the cool-downs running at the replay's start
        for job_id, at in sorted(started.items()):
            held = admission.admitted.get(job_id)
            if held is not None:
                self.started(job_id, held.spec, at)

    def ended(self, job_id: str) -> None:
        self.stopped(job_id)

    def wake_at(self, now: float) -> float | None:
        """When a request held back by a protection window or a cool-down is decided again (None: none is)."""
        return self.replay_asks.wake_at(now)


@dataclass(frozen=True)
class EtaRange:
    """An ETA: the most likely start and the p10-p90 interval (same clock as the `now` it was made at), the start
    the replay planned and the range of the p10 / p90 replays before calibration (what the calibration record
    compares with the actual start)."""

    start: float
    low: float
    high: float
    planned: float = float("nan")
    replay_low: float = float("nan")
    replay_high: float = float("nan")

    @property
    def replayed(self) -> float:
        return self.start if math.isnan(self.planned) else self.planned

    @property
    def replayed_range(self) -> tuple[float, float]:
        return (self.low if math.isnan(self.replay_low) else self.replay_low,
                self.high if math.isnan(self.replay_high) else self.replay_high)


@dataclass(frozen=True)
class RunningView:
    """What the ETA knows of a job holding GPUs: its spec, when it started, its checkpoint progress if reported."""

    spec: JobSpec
    started_at: float
    progress: float | None = None  # fraction of its work done, 0-1


def stratum(waited_s: float) -> str:
    """The calibration stratum of an ETA given to a job that has waited `waited_s` already: whether it just
    arrived (a first ETA meets every later arrival ahead of it) or has waited (a later ETA has seen some of them,
    and running jobs have run longer: its replay errs differently)."""
    return "f" if waited_s < MIN_WAIT_S else "r"


def conformal_quantile(scores: list[float], level: float) -> float | None:
    """The split-conformal quantile of `scores` at `level`: the ceil((n + 1) level)-th smallest, which a new
    exchangeable score stays under with probability at least `level` for any n; None when n is too small."""
    n = len(scores)
    k = math.ceil((n + 1) * level - 1e-9)
    if n == 0 or k > n:
        return None
    return sorted(scores)[max(k, 1) - 1]


def conformal_bounds(errors: list[float], low_q: float, high_q: float) -> tuple[float, float] | None:
    """(lower, upper) split-conformal order statistics of `errors` for the central interval between the `low_q`
    and `high_q` quantiles: the floor((n + 1) low_q)-th smallest (the smallest when that is 0) and the
    ceil((n + 1) high_q)-th smallest, each a one-sided bound a new exchangeable error passes with probability at
    most its tail's; None when n is too small for the upper one."""
    n = len(errors)
    k_hi = math.ceil((n + 1) * high_q - 1e-9)
    if n == 0 or k_hi > n:
        return None
    k_lo = math.floor((n + 1) * low_q + 1e-9)
    ordered = sorted(errors)
    return ordered[max(k_lo, 1) - 1], ordered[max(k_hi, 1) - 1]


def _log_wait(t: float, given_at: float) -> float:
    return math.log(max(MIN_WAIT_S, t - given_at))


class EtaCalibration:
    """The record of ETAs given against actual starts, per queue (and over all queues), first ETAs apart from
    later ones; it turns the replays' p10-p90 range into an interval that holds the nominal share of starts.

    The replays' range (every duration at its own p10, then p90) is a range of durations, not of starts: what
    arrives later and the order in which similar jobs end are not in it, so it covers some other share than 80%.
    Conformalized quantile regression (Romano, Patterson and Candès, 2019) corrects it from the record: each
    start scores how far outside the replayed range it fell, in log wait (waits floored at a minute), negative
    inside: s = max(log(low / actual), log(actual / high)). With Q the split-conformal quantile of the last
    `window` scores at the nominal level (`conformal_quantile`), [low·e^-Q, high·e^Q] holds a new start with at
    least that probability when the record is exchangeable with it; Q < 0 narrows a range that covers too much.
    From the records of the same queue and stratum (else all queues' of that stratum, else the queue's, else
    all), once one has `min_samples` entries (a quarter of the window: the 80% quantile of fewer is noisy);
    before that, the replayed range as is. The most likely start is the replay's, not shifted by the record's
    median error: that error follows the load (bursts) and a record of past ones corrects the wrong way as often
    as the right one. `accuracy` gives the figures the admission service exports, from what users were shown.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, min_samples: int = DEFAULT_WINDOW // 4,
                 low_q: float = LOW_Q, high_q: float = HIGH_Q, min_wait_s: float = 0.0):
        if window < 1 or not 1 <= min_samples <= window or not 0.0 <= low_q < high_q <= 1.0:
            raise ValueError(f"need 1 <= min_samples <= window and 0 <= low_q < high_q <= 1, got {window}, "
                             f"{min_samples}, {low_q}, {high_q}")
        self.min_wait_s = min_wait_s
        self.min_samples = min_samples
        self.level = high_q - low_q  # the nominal coverage of the range (p10-p90: 80%)
        self._scores: dict[str, deque[float]] = {}  # stratum key -> conformity scores, the last `window`
        self._checks: dict[str, deque[tuple[float, bool]]] = {}  # queue -> (|err| as a fraction, in range)
        # stratum key -> log(actual wait / shown wait) of the shown start, the last `window` (`error_range`)
        self._errors: dict[str, deque[float]] = {}
        self.low_q, self.high_q = low_q, high_q
        self.window = window

    def record(self, queue: str, given_at: float, eta: EtaRange, started_at: float, submitted_at: float) -> None:
        """A job of `queue` submitted at `submitted_at` was given `eta` at `given_at` and started at `started_at`."""
        if started_at - given_at < self.min_wait_s:
            return  # a start this soon says little about a forecast: neither scored nor recorded
        actual = _log_wait(started_at, given_at)
        low, high = eta.replayed_range
        score = max(_log_wait(low, given_at) - actual, actual - _log_wait(high, given_at))
        band = stratum(given_at - submitted_at)
        error = actual - _log_wait(eta.start, given_at)  # (late positive)
        # (a start shown and made within a minute is no ratio: its error, 0 by the floor, is not kept, or a record
        # of jobs that start at once would narrow every waiting job's range)
        ratio = max(eta.start, started_at) - given_at >= MIN_WAIT_S
        for key in (f"{queue}|{band}", f"{ALL_QUEUES}|{band}", queue, ALL_QUEUES):
            self._scores.setdefault(key, deque(maxlen=self.window)).append(score)
            if ratio:
                self._errors.setdefault(key, deque(maxlen=self.window)).append(error)
        shown = max(MIN_WAIT_S, eta.start - given_at)
        wait = max(MIN_WAIT_S, started_at - given_at)
        covered = eta.low - 1.0 <= started_at <= eta.high + 1.0
        for key in (queue, ALL_QUEUES):
            self._checks.setdefault(key, deque(maxlen=self.window)).append((abs(shown - wait) / wait, covered))

    def margin(self, queue: str, waited_s: float, memo: dict[tuple[str, str], float | None] | None = None
               ) -> float | None:
        """Q, the log-wait margin to add on both sides of a replayed range given to a job of `queue` that has
        waited `waited_s`; None while no record stands in. `memo`: a dict a caller asking for many jobs while the
        record does not change keeps (a refresh: one quantile per queue and stratum, not a sort per job)."""
        band = stratum(waited_s)
        if memo is not None and (queue, band) in memo:
            return memo[(queue, band)]
        q: float | None = None
        for key in (f"{queue}|{band}", f"{ALL_QUEUES}|{band}", queue, ALL_QUEUES):
            scores = self._scores.get(key, ())
            if len(scores) >= self.min_samples:
                q = conformal_quantile(list(scores), self.level)
                break
        if memo is not None:
            memo[(queue, band)] = q
        return q

    def calibrated(self, queue: str, now: float, start: float, low: float, high: float,
                   submitted_at: float, memo: dict[tuple[str, str], float | None] | None = None) -> EtaRange:
        """The ETA of a job of `queue` submitted at `submitted_at` whose replays planned `start` and the range
        `low`-`high`: the range widened (or narrowed) by the record's conformal margin, the start as planned.
        `memo`: as `margin`'s."""
        q = self.margin(queue, now - submitted_at, memo)
        lo, hi = min(low, start), max(high, start)
        if q is None:
            return EtaRange(start, lo, hi, planned=start, replay_low=low, replay_high=high)
        cal_lo = now + math.exp(_log_wait(lo, now) - q)
        cal_hi = now + math.exp(_log_wait(hi, now) + q)
        # (waits are floored at a minute: a margin moves a bound only the way it means to)
        cal_lo, cal_hi = (min(lo, cal_lo), max(hi, cal_hi)) if q >= 0 else (max(lo, cal_lo), min(hi, cal_hi))
        return EtaRange(start, min(cal_lo, start), max(cal_hi, start), planned=start, replay_low=low,
                        replay_high=high)

    def error_range(self, queue: str, waited_s: float,
                    memo: dict[tuple[str, str], tuple[float, float] | None] | None = None
                    ) -> tuple[float, float] | None:
        """(lower, upper) log-wait errors of the shown start (log(actual wait / shown wait)) that a new start
        of a job of `queue` that has waited `waited_s` falls between with the range's nominal probability:
        the split-conformal order statistics of the record (`conformal_bounds`), from the same queue and
        stratum, else all queues' of that stratum, else the queue's, else all, once one has `min_samples`;
        None before that (cold start: `calibrated_range` gives the wide COLD_WIDEN range). `memo`: as
        `margin`'s."""
        band = stratum(waited_s)
        if memo is not None and (queue, band) in memo:
            return memo[(queue, band)]
        found: tuple[float, float] | None = None
        for key in (f"{queue}|{band}", f"{ALL_QUEUES}|{band}", queue, ALL_QUEUES):
            errors = self._errors.get(key, ())
            if len(errors) >= self.min_samples:
                found = conformal_bounds(list(errors), self.low_q, self.high_q)
                if found is not None:
                    break
        if memo is not None:
            memo[(queue, band)] = found
        return found

    def calibrated_range(self, queue: str, now: float, start: float, submitted_at: float, widen: float = 1.0,
                         memo: dict[tuple[str, str], tuple[float, float] | None] | None = None) -> EtaRange:
        """The ETA of a job of `queue` submitted at `submitted_at` whose median replay planned `start`, with no
        p10 / p90 replay (`range_method` "calibrated"): its wait scaled by the record's error quantiles
        (`error_range`), [w·e^lo, w·e^hi] (waits floored at a minute), then divided / multiplied by `widen` (a
        coarse start's TAIL_WIDEN). Cold start (no record with `min_samples` entries yet): [w / COLD_WIDEN,
        w · COLD_WIDEN]. The range always holds the start."""
        found = self.error_range(queue, now - submitted_at, memo)
        lo_err, hi_err = (-math.log(COLD_WIDEN), math.log(COLD_WIDEN)) if found is None else found
        wait = _log_wait(start, now)
        low = now + math.exp(wait + min(0.0, lo_err)) / widen
        high = now + math.exp(wait + max(0.0, hi_err)) * widen
        low, high = min(low, start), max(high, start)
        return EtaRange(start, low, high, planned=start, replay_low=low, replay_high=high)

    def accuracy(self, queue: str) -> dict[str, float]:
        """Over the queue's last `window` ETAs: how many, the fraction within ±20% and ±50% of the actual wait,
        the fraction whose start fell in its range, and the median signed error (late positive) as a fraction."""
        checks = list(self._checks.get(queue, ()))
        if not checks:
            return {"count": 0.0}
        n = len(checks)
        return {"count": float(n), "within_20pct": sum(e <= 0.2 for e, _ in checks) / n,
                "within_50pct": sum(e <= 0.5 for e, _ in checks) / n,
                "interval_coverage": sum(c for _, c in checks) / n}

    def queues(self) -> list[str]:
        return sorted(q for q in self._checks if q != ALL_QUEUES)


@dataclass(frozen=True)
class Arrival:
    """A job the ETA saw arrive: when it was submitted, its priority value, its expected work (its GPU share,
    whole GPUs and MIG slices, x the predicted median run time when it was seen) and the GPU models it accepts
    (empty: any)."""

    at: float
    job_id: str
    priority: int
    gpu_s: float
    gpu_models: tuple[str, ...] = ()


def gpu_share(spec: JobSpec) -> float:
    """The GPUs a job holds while it runs: whole GPUs plus each MIG slice's share of a GPU."""
    # (the slices' term only where a pod set has slices: adding 0.0 changes no sum, and parsing the profile cost
    # most of a deep queue's tail)
    return spec.total_gpus + sum([p.mig_slices * mig_milli_gpus(p.mig_profile) / MILLI_GPU
                                  for p in spec.pod_sets if p.mig_slices], 0.0)


def _pool(pools: Mapping[str, int], models: Sequence[str]) -> int:
    """GPUs of the models in `models` (empty: every model)."""
    return sum(n for m, n in pools.items() if not models or m in models)


def _overlap(pools: Mapping[str, int], theirs: Sequence[str], mine: Sequence[str]) -> float:
    """The share of an arrival's work that lands on the GPUs of `mine`: an arrival accepting the models `theirs`
    spreads over their GPUs in proportion to each model's count (the fluid view), so only the part on models
    both accept competes (all of it when both accept any model)."""
    if not theirs and not mine:
        return 1.0
    pool = _pool(pools, theirs)
    if pool <= 0:
        return 0.0
    both = sum(n for m, n in pools.items() if (not theirs or m in theirs) and (not mine or m in mine))
    return both / pool


class ArrivalHistory:
    """The jobs each queue received (bounded, in memory), and the delay the arrivals still to come are expected
    to add to a waiting job's start.

    The replay assumes nothing new arrives, yet a job of the queue with a higher priority, submitted while a job
    waits, is admitted and placed before it (the pipeline orders by priority first) and takes GPU-seconds it
    would have had. The forecast is "the next `wait` looks like the last `wait`": for a job the replay starts in
    `wait` seconds, the higher-priority jobs its queue received over the last `wait` (n jobs, A GPU-seconds of
    predicted work on the GPUs of the models it can use, the last one d seconds ago) are expected again, and
    take A / capacity seconds from it (the fluid view: those GPUs drain A GPU-seconds that much later). An
    arrival that accepts other models too counts with the share of its work that falls on this job's models
    (`_overlap`); one that accepts none of them does not count. Streams of submissions end (a sweep is
    submitted in minutes, then nothing): the forecast is weighted by exp(-n d / wait), the
    chance that a stream still arriving at its look-back rate n / wait leaves a silence as long as the one seen
    since its last job (Poisson), so a sweep that ended long before adds nothing. One step: arrivals during the
    added delay itself are not counted again (the streams end). Lower- and equal-priority arrivals of the queue
    come after the job (submission order), and other queues' arrivals are served from their own quota first,
    so neither is counted (a queue borrowing another's idle quota loses it to that queue's arrivals: not
    modelled).
    """

    def __init__(self, max_age_s: float = DEFAULT_HORIZON_S, max_entries: int = ARRIVAL_HISTORY):
        if max_age_s <= 0 or max_entries < 1:
            raise ValueError(f"need max_age_s > 0 and max_entries >= 1, got {max_age_s}, {max_entries}")
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._queues: dict[str, list[tuple[float, str, Arrival]]] = {}  # queue -> sorted (at, job_id, arrival)
        self._seen: dict[str, float] = {}  # job_id -> when it was submitted (each job counts once)
        # queue -> (priority, models) -> (arrival times, prefix sums of their work): `expected_delay` in
        # O(groups x log n) instead of a walk over the look-back (a refresh asks it once per waiting job);
        # rebuilt per queue after the history changed
        self._index: dict[str, list[tuple[int, tuple[str, ...], list[float], list[float]]]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._seen

    def __deepcopy__(self, memo: dict[int, Any]) -> ArrivalHistory:
        """An independent copy (PlatformEta replays on a copy of its model, under its lock): the lists are
        copied, the arrivals (immutable) shared, so a week of them copies in a fraction of a deep copy's time."""
        other = ArrivalHistory(self.max_age_s, self.max_entries)
        other._queues = {q: list(entries) for q, entries in self._queues.items()}
        other._seen = dict(self._seen)
        other._index = dict(self._index)  # (rebuilt, never changed in place: shared safely)
        return other

    def observe(self, queue: str, arrival: Arrival, now: float) -> None:
        """A job of `queue` seen waiting or holding quota at `now` (again: ignored); forgets arrivals older than
        `max_age_s`."""
        self.observe_many([(queue, arrival)], now)

    def observe_many(self, arrivals: Iterable[tuple[str, Arrival]], now: float) -> None:
        """`observe` for many (queue, arrival) at once: what is too old or too many is forgotten once, after all
        (a refresh sees thousands of new jobs; forgetting after each one was most of the refresh's work in the
        service's event loop)."""
        cutoff = now - self.max_age_s
        added = False
        for queue, arrival in arrivals:
            if arrival.job_id in self._seen or arrival.at < cutoff:
                continue  # (a job older than the history, still waiting or running, is never counted)
            self._seen[arrival.job_id] = arrival.at
            bisect.insort(self._queues.setdefault(queue, []), (arrival.at, arrival.job_id, arrival))
            added = True
        if added:
            self._index = {}
            self._forget(now)

    def _groups(self, queue: str) -> list[tuple[int, tuple[str, ...], list[float], list[float]]]:
        groups = self._index.get(queue)
        if groups is None:
            by: dict[tuple[int, tuple[str, ...]], tuple[list[float], list[float]]] = {}
            for at, _, a in self._queues.get(queue, ()):
                times, sums = by.setdefault((a.priority, a.gpu_models), ([], [0.0]))
                times.append(at)
                sums.append(sums[-1] + a.gpu_s)
            groups = self._index[queue] = [(p, m, times, sums) for (p, m), (times, sums) in sorted(by.items())]
        return groups

    def _forget(self, now: float) -> None:
        cutoff = now - self.max_age_s
        for queue in sorted(self._queues):
            entries = self._queues[queue]
            drop = bisect.bisect_left(entries, (cutoff,))
            drop = max(drop, len(entries) - self.max_entries)
            for _, job_id, _ in entries[:drop]:
                self._seen.pop(job_id, None)
            del entries[:drop]
            if not entries:
                del self._queues[queue]

    def overtaking(self, queue: str, priority: int, since: float, now: float) -> list[Arrival]:
        """The arrivals of `queue` with a priority above `priority` submitted in (since, now]."""
        entries = self._queues.get(queue, [])
        lo = bisect.bisect_right(entries, (since, "\uffff"))
        hi = bisect.bisect_right(entries, (now, "\uffff"))
        return [a for _, _, a in entries[lo:hi] if a.priority > priority]

    def expected_delay(self, queue: str, priority: int, now: float, wait_s: float, pools: Mapping[str, int],
                       models: Sequence[str] = (), memo: dict[Any, Any] | None = None) -> float:
        """Seconds the arrivals still to come are expected to add to the start of a job of `queue` with
        `priority` that the replay starts `wait_s` from `now`, on the GPUs of `models` (empty: any), `pools`
        giving each model's GPUs (class doc). `memo`: a dict kept by a caller asking for many jobs with the same
        history and `pools` (a refresh): the groups that compete with each (queue, priority, models), found once."""
        key = (queue, priority, tuple(models))
        found = memo.get(key) if memo is not None else None
        if found is None:
            capacity = _pool(pools, models)
            # (priority, models) groups above `priority` whose work lands on `models`, arrivals by time
            found = (capacity, [] if capacity <= 0 else
                     [(times, sums, share) for prio, theirs, times, sums in self._groups(queue)
                      if prio > priority and (share := _overlap(pools, theirs, models)) > 0.0])
            if memo is not None:
                memo[key] = found
        capacity, groups = found
        if capacity <= 0:
            return 0.0
        lookback = max(MIN_WAIT_S, wait_s)
        since = now - lookback
        work, last, n = 0.0, -math.inf, 0
        for times, sums, share in groups:
            lo, hi = bisect.bisect_right(times, since), bisect.bisect_right(times, now)
            if hi > lo:
                work, last, n = work + share * (sums[hi] - sums[lo]), max(last, times[hi - 1]), n + hi - lo
        if not n:
            return 0.0
        still_arriving = math.exp(-n * max(0.0, now - last) / lookback)
        return still_arriving * work / capacity


@dataclass
class EtaModel:
    """What ETAs learn online: how long finished jobs ran (the predictor) and how ETAs fared (calibration).

    `predict=False` is the old behaviour (every job runs for its whole limit), kept to measure against."""

    predictor: DurationPredictor = field(default_factory=DurationPredictor)
    calibration: EtaCalibration = field(default_factory=EtaCalibration)
    arrivals: ArrivalHistory = field(default_factory=ArrivalHistory)
    predict: bool = True
    calibrate: bool = True
    expect_arrivals: bool = True  # False: the replay alone ("nothing new arrives"), kept to measure against
    # False: nothing is preempted in the replay (jobs wait for the ends of the lower-priority jobs holding their
    # quota), kept to measure against
    expect_preemption: bool = True
    # How the p10-p90 range is made (RANGE_METHODS): "replays" (two more replays, the default) or "calibrated" (the
    # median replay alone and the record's error quantiles, `EtaCalibration.calibrated_range`)
    range_method: str = RANGE_METHODS[0]

    def __post_init__(self) -> None:
        if self.range_method not in RANGE_METHODS:
            raise ValueError(f"unknown ETA range method {self.range_method!r}; choose from {', '.join(RANGE_METHODS)}")

    def observe_arrivals(self, admission: Any, now: float) -> None:
        """Every job waiting or holding quota in `admission` goes to the arrival history (once per job), with its
        predicted work as of now. Called before each refresh: a job is seen unless it arrived, ran and ended
        between two refreshes (minutes of platform time)."""
        self.arrivals.observe_many(self.new_arrivals(admission, now), now)

    def new_arrivals(self, admission: Any, now: float) -> list[tuple[str, Arrival]]:
        """What `observe_arrivals` would add: (queue, arrival) of the jobs in `admission` the history has not seen.
        Changes nothing (a forked child finds them, the service's process only adds them)."""
        cutoff = now - self.arrivals.max_age_s
        seen = self.arrivals
        # (only the jobs the history has not seen: after the first refresh, a few)
        new = sorted((j, (w.spec, w.submitted_at)) for held in (admission.pending, admission.admitted)
                     for j, w in held.items() if j not in seen and w.submitted_at >= cutoff)
        found: list[tuple[str, Arrival]] = []
        for job_id, (spec, submitted_at) in new:
            priority = admission.priority(job_id)
            if priority is None:
                from services.core.pipeline import priority_value

                priority = priority_value(admission.config, spec)
            found.append((spec.queue, Arrival(submitted_at, job_id, priority, gpu_share(spec) * self.duration(spec),
                                              spec.gpu_models)))
        return found

    def job_finished(self, spec: JobSpec, ran_s: float, ended_at: float | None = None) -> None:
        """A job ended after running `ran_s` seconds in all (at `ended_at`, when known: its start, the end less
        the run time, makes it cohort evidence for the running jobs of its group): history for the predictor."""
        ran = max(0.0, ran_s)
        self.predictor.observe(JobKey.of(spec), float(spec.max_runtime_s), ran,
                               started_at=None if ended_at is None else ended_at - ran)

    def job_started(self, queue: str, given_at: float, eta: EtaRange, started_at: float,
                    submitted_at: float) -> None:
        """A job submitted at `submitted_at`, given `eta` at `given_at`, started at `started_at`: one more record
        for calibration."""
        self.calibration.record(queue, given_at, eta, started_at, submitted_at)

    def duration(self, spec: JobSpec) -> float:
        if not self.predict:
            return float(spec.max_runtime_s)
        return self.predictor.predict(JobKey.of(spec), float(spec.max_runtime_s)).median_s

    def expected_end(self, job: RunningView, now: float, which: str = "median") -> float:
        return self.expected_ends(job, now)[{"low": 0, "high": 2}.get(which, 1)]

    def expected_ends(self, job: RunningView, now: float, median_only: bool = False) -> tuple[float, float, float]:
        """When a job holding GPUs is expected to end: (p10, median, p90). Its cohort's running jobs are the ones
        the last `all_expected_ends` handed the predictor. `median_only`: (median,) * 3, the same median without
        the p10 / p90 searches (a refresh running the median replay alone reads nothing else)."""
        limit = float(job.spec.max_runtime_s)
        if not self.predict:
            return (job.started_at + limit,) * 3
        key, elapsed = JobKey.of(job.spec), now - job.started_at
        if median_only and job.progress is None:
            at, _, _ = self.predictor.remaining_quantiles(key, limit, elapsed, started_at=job.started_at)
            return (now + at(0.5),) * 3  # (what `remaining` gives as its median: the same function at 0.5)
        p = self.predictor.remaining(key, limit, elapsed, job.progress, started_at=job.started_at)
        if median_only:
            return (now + p.median_s,) * 3
        return now + p.low_s, now + p.median_s, now + p.high_s

    def all_expected_ends(self, running: Mapping[str, RunningView], now: float, median_only: bool = False
                          ) -> dict[str, tuple[float, float, float]]:
        """`expected_ends` of every running job. The running jobs go to the predictor first (`running_now`), so
        that each job hears the others of its group started near it: how long they have run, and their limits
        (`pooled_prior`)."""
        if not self.predict:
            return {job_id: self.expected_ends(r, now, median_only) for job_id, r in sorted(running.items())}
        self.predictor.running_now([(JobKey.of(r.spec), float(r.spec.max_runtime_s), r.started_at)
                                    for _, r in sorted(running.items())])
        # A prediction is a function of the job's group key, limit, start and progress (and of the predictor,
        # which does not change here): jobs alike in all four (a sweep's jobs started in the same cycle with the
        # same limit; a quarter of the predictions on Philly October) are predicted once.
        out: dict[str, tuple[float, float, float]] = {}
        alike: dict[tuple[JobKey, int, float, float | None], tuple[float, float, float]] = {}
        for job_id, r in sorted(running.items()):
            key = (JobKey.of(r.spec), r.spec.max_runtime_s, r.started_at, r.progress)
            ends = alike.get(key)
            if ends is None:
                ends = alike[key] = self.expected_ends(r, now, median_only)
            out[job_id] = ends
        return out

    @property
    def median_replay_only(self) -> bool:
        """Whether a refresh runs the median replay alone (`_RefreshReplays.run`): no p10 / p90 replay, so the
        running jobs' p10 / p90 ends are never read."""
        return not self.predict or self.range_method == "calibrated"


def estimate_ranges(cluster: Any, admission: Any, running: Mapping[str, RunningView], now: float,
                    model: EtaModel, *, horizon_s: float = DEFAULT_HORIZON_S, backfill: bool = True,
                    fixed_ends: Mapping[str, float] | None = None,
                    preempted_at: Mapping[str, float] | None = None,
                    budget: int | None = DEFAULT_BUDGET) -> dict[str, EtaRange]:
    """{job_id: EtaRange} for every waiting job that would start within `horizon_s` (see the module doc).
    `fixed_ends`: jobs holding GPUs whose spec is not known here (another admission instance's), by the end the
    scheduler reserves for them (started_at + limit). `preempted_at`: when waiting jobs were last preempted
    (`estimate_starts`; the replay preempts unless `model.expect_preemption` is off). `budget`: the refresh's
    work, its replays together (DEFAULT_BUDGET job-cycles; None: exact whatever the depth): the median replay
    spends up to half, the p10 and p90 replays half of what it left each; a job the median replay gave a coarse
    start gets a range wider by TAIL_WIDEN on each side (in wait: low / TAIL_WIDEN, high x TAIL_WIDEN) before
    calibration."""
    fixed = dict(fixed_ends or {})
    plans = _RefreshReplays(cluster, admission, running, now, model, fixed=fixed, backfill=backfill,
                            horizon_s=horizon_s, preempted_at=preempted_at, budget=budget)
    starts, low, high = plans.run()
    if model.expect_arrivals:  # each replay's start, later by what the arrivals to come are expected to take
        later = _arrival_delays(cluster, admission, now, model)
        starts, low, high = (later(starts), later(low), later(high))
    return _ranges(model, waiting_queues(admission), now, starts, low, high, plans.coarse)


class _RefreshReplays:
    """The replays of one refresh (`estimate_ranges`): the median, then the p10 and p90 ones, within the
    refresh's budget, on the head of the queue cut once for the three."""

    def __init__(self, cluster: Any, admission: Any, running: Mapping[str, RunningView], now: float,
                 model: EtaModel, *, fixed: dict[str, float], backfill: bool, horizon_s: float,
                 preempted_at: Mapping[str, float] | None, budget: int | None):
        self.cluster, self.now, self.model, self.fixed = cluster, now, model, fixed
        self.backfill, self.horizon_s, self.preempted_at, self.budget = backfill, horizon_s, preempted_at, budget
        self.believed = {**fixed, **{j: r.started_at + r.spec.max_runtime_s for j, r in running.items()}}
        # once for all replays (the median alone when it is the only replay)
        self.expected = model.all_expected_ends(running, now, median_only=model.median_replay_only)
        self.started = {j: r.started_at for j, r in running.items()} if model.expect_preemption else None
        self.coarse: frozenset[str] = frozenset()
        # The refresh's budget: the median replay takes up to half (all when it is the only one), the p10 and p90
        # replays share what it left. The head of the queue and the tail beyond it are cut once for the three
        # replays (their ends differ, not the queue), by the median's share.
        self.first = budget if budget is None or not model.predict else max(1, budget // 2)
        self.spent = 0
        self.head: Any = admission
        self.tail: list[TailJob] | None = None
        if self.first is not None:
            self.head, self.tail = cut_queue(cluster, admission, set(fixed) | set(self.expected), self.first)
        # job_id -> its prediction (the replays and the tail ask for each job), made once per (group, limit): the
        # predictor does not change during a refresh, and a deep queue is mostly sweeps of a few groups
        self._predicted: dict[str, Prediction] = {}
        self._by_key: dict[tuple[JobKey, int], Prediction] = {}

    def prediction(self, spec: JobSpec) -> Prediction:
        p = self._predicted.get(spec.job_id)
        if p is None:
            key = (JobKey.of(spec), spec.max_runtime_s)
            p = self._by_key.get(key)
            if p is None:
                p = self._by_key[key] = self.model.predictor.predict(key[0], float(spec.max_runtime_s))
            self._predicted[spec.job_id] = p
        return p

    def ends_of(self, which: str) -> dict[str, float]:
        pick = {"low": 0, "high": 2}.get(which, 1)
        return {**self.fixed, **{j: e[pick] for j, e in self.expected.items()}}

    def duration_of(self, which: str) -> Duration:
        if not self.model.predict:
            return self.model.duration
        prediction = self.prediction

        def duration(spec: JobSpec) -> float:
            p = prediction(spec)
            return p.median_s if which == "median" else p.low_s if which == "low" else p.high_s
        return duration

    def _share(self, which: str) -> int | None:
        if which == "median" or self.budget is None:
            return self.first
        return max(1, (self.budget - self.spent) // 2)

    def from_scratch(self, which: str) -> dict[str, float]:
        """One replay on its own, from scratch (`_plan`)."""
        tail = self.tail if which == "median" or self.tail is None else []
        # (the tail beyond the head only in the median replay: its range comes from its coarse start)
        planned, rough, cost = _plan(self.cluster, self.head, self.ends_of(which), self.now,
                                     horizon_s=self.horizon_s, max_cycles=10_000, backfill=self.backfill,
                                     duration=self.duration_of(which), believed_ends=self.believed,
                                     resolution=RESOLUTION, started=self.started, preempted_at=self.preempted_at,
                                     budget=self._share(which), tail=tail)
        if which == "median":
            self.coarse, self.spent = rough, cost
        return planned

    def run(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """(median starts, p10 starts, p90 starts). The three replays decide their first instant alike (its
        decisions read the reserved ends, not the predicted ones): it is decided once, in the median replay, and
        the p10 and p90 replays start from its forks (`_StartsReplay.fork`), each charged the job-cycles it would
        have spent itself, so every start equals the one its replay from scratch gives. (One replays from scratch
        when its share of the budget would have stopped its first instant elsewhere.)"""
        if self.model.median_replay_only:
            # (calibrated: the median replay alone, with the same head and budget share as with the replays, so
            # its starts are the same; the range comes from the record, `_ranges`)
            return self.from_scratch("median"), {}, {}
        from services.core.pipeline import decide

        base = _StartsReplay(self.cluster, self.head, self.ends_of("median"), self.now, decide=decide,
                             backfill=self.backfill, run_for=self.duration_of("median"), believed_ends=self.believed,
                             started=self.started, preempted_at=self.preempted_at, tail=self.tail or ())
        base.budget, base.log = self.first, []
        if base.anything_waiting():
            base.settle(self.now)
        forks = {which: base.fork(self.ends_of(which), self.duration_of(which)) for which in ("low", "high")}
        base.log = None
        starts, self.coarse, self.spent = _run(base, horizon_s=self.horizon_s, max_cycles=10_000,
                                               resolution=RESOLUTION, budget=self.first, settled=True)
        # The range of the replays with every duration at its p10, then its p90: the base the record calibrates.
        ranges: dict[str, dict[str, float]] = {}
        for which in ("low", "high"):
            share, fork = self._share(which), forks[which]
            if fork.shares_first_instant(share):  # (the fork holds the base's budget record of the first instant)
                fork.budget = share
                ranges[which] = _run(fork, horizon_s=self.horizon_s, max_cycles=10_000, resolution=RESOLUTION,
                                     budget=share, settled=True)[0]
            else:
                ranges[which] = self.from_scratch(which)
        return starts, ranges["low"], ranges["high"]


def _ranges(model: EtaModel, queued: Mapping[str, tuple[str, float]], now: float, starts: Mapping[str, float],
            low: Mapping[str, float], high: Mapping[str, float], coarse: frozenset[str]) -> dict[str, EtaRange]:
    """The replays' starts -> each waiting job's EtaRange (`estimate_ranges`), calibrated unless the model says
    not to."""
    out: dict[str, EtaRange] = {}
    margins: dict[tuple[str, str], float | None] = {}  # (the record does not change during a refresh)
    if model.predict and model.range_method == "calibrated":
        errors: dict[tuple[str, str], tuple[float, float] | None] = {}
        for job_id, start in starts.items():
            queue, submitted_at = queued.get(job_id, ("", now))
            out[job_id] = model.calibration.calibrated_range(queue, now, start, submitted_at,
                                                             TAIL_WIDEN if job_id in coarse else 1.0, errors)
        return dict(sorted(out.items()))
    for job_id, start in starts.items():
        lo, hi = min(start, low.get(job_id, start)), max(start, high.get(job_id, start))
        if job_id in coarse:
            # the tail beyond the head has no p10 / p90 replay: its range is its coarse wait widened twice
            widen = TAIL_WIDEN if job_id in low or job_id in high or not model.predict else TAIL_WIDEN ** 2
            lo, hi = now + (lo - now) / widen, now + (hi - now) * widen
        if model.calibrate:
            queue, submitted_at = queued.get(job_id, ("", now))
            out[job_id] = model.calibration.calibrated(queue, now, start, lo, hi, submitted_at, margins)
        else:
            out[job_id] = EtaRange(start, lo, hi, planned=start, replay_low=lo, replay_high=hi)
    return dict(sorted(out.items()))


def _arrival_delays(cluster: Any, admission: Any, now: float, model: EtaModel
                    ) -> Callable[[Mapping[str, float]], dict[str, float]]:
    """Planned starts -> the same, each later by its expected delay from arrivals (ArrivalHistory)."""
    pools = cluster.total_gpus_by_model()
    pending, admitted = admission.pending, admission.admitted
    memo: dict[Any, Any] = {}  # (the history and pools are the same for every job of the refresh)
    # job_id -> (queue, priority, GPU models), or None: not waiting here (asked once per job for the three replays)
    asks: dict[str, tuple[str, int, tuple[str, ...]] | None] = {}
    delay = model.arrivals.expected_delay

    def ask(job_id: str) -> tuple[str, int, tuple[str, ...]] | None:
        held = pending.get(job_id) or admitted.get(job_id)
        priority = admission.priority(job_id)
        found = None if held is None or priority is None else (held.spec.queue, priority, held.spec.gpu_models)
        asks[job_id] = found
        return found

    def later(planned: Mapping[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for job_id, start in planned.items():
            who = asks[job_id] if job_id in asks else ask(job_id)
            out[job_id] = start if who is None else start + delay(who[0], who[1], now, start - now, pools, who[2],
                                                                  memo)
        return out

    return later


def waiting_queues(admission: Any) -> dict[str, tuple[str, float]]:
    """job_id -> (queue, submitted at) of every waiting job (pending and admitted)."""
    return {**{j: (w.spec.queue, w.submitted_at) for j, w in admission.pending.items()},
            **{j: (a.spec.queue, a.submitted_at) for j, a in admission.admitted.items()}}


def refresh_due(last_refresh: float | None, now: float, changed: bool, interval_s: float = ETA_REFRESH_S,
                min_interval_s: float = ETA_MIN_REFRESH_S, all_beyond: bool = False) -> bool:
    """Whether ETAs are recomputed now, in platform time: after a change (a job ended, started, arrived or left
    the queue) once `min_interval_s` passed since the last refresh, and otherwise every `interval_s` of the
    platform clock (elapsed times move on). Never paced by wall seconds: at 400x a wall second is 400 s.
    `all_beyond`: the last refresh started no waiting job within the horizon (a pod no node can hold, a queue
    days long); time alone then refreshes every IDLE_REFRESH_S, the replay's resolution at the horizon: a start
    that time brings within the horizon is shown by then, as late as the replay's own rounding."""
    if last_refresh is None:
        return True
    elapsed = now - last_refresh
    if all_beyond and not changed:
        return elapsed >= max(interval_s, IDLE_REFRESH_S)
    return elapsed >= interval_s or (changed and elapsed >= min_interval_s)


def replay_reserved(model: EtaModel, cluster: Any, admission: Any, reserved_ends: Mapping[str, float], now: float,
                    preempted_at: Mapping[str, float] | None = None, budget: int | None = DEFAULT_BUDGET
                    ) -> dict[str, EtaRange]:
    """The forward simulation of a refresh (it may change `model` and `admission`: callers pass copies): every job
    holding GPUs ends by `reserved_ends`, predicted where admission holds its spec (services/eta/platform.py)."""
    running: dict[str, RunningView] = {}
    fixed: dict[str, float] = {}
    for job_id, end in sorted(reserved_ends.items()):
        held = admission.admitted.get(job_id)
        if held is None:
            fixed[job_id] = end
        else:
            running[job_id] = RunningView(held.spec, started_at=end - held.spec.max_runtime_s)
    return estimate_ranges(cluster, admission, running, now, model, fixed_ends=fixed, preempted_at=preempted_at,
                           budget=budget)
