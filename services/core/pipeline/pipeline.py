"""The pipeline's rules and its cycle (the package docstring says what it owns and why)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.core.admission import AdmissionDecision, AdmissionState, AdmittedWorkload, admission_cycle
from services.core.scheduler import (
    ClusterIndex,
    CycleResult,
    Hold,
    PendingJob,
    Reason,
    RunningJob,
    schedule_cycle,
)
from shared.config import QueuesConfig
from shared.domain import JobSpec

# Reasons a preemption can cure: the job would fit if running jobs gave their GPUs (or CPU/memory) back.
CURABLE = frozenset({Reason.INSUFFICIENT_GPUS, Reason.INSUFFICIENT_CPU_MEMORY, Reason.TOPOLOGY_UNSATISFIABLE})


# The least time capacity freed by a preemption stays held for its preemptor (`hold_until`): admission needs a moment
# to admit the preemptor once the preemption released its quota, even with a checkpoint grace of 0.
MIN_HOLD_S = 30.0


def hold_until(now: float, checkpoint_grace_s: float) -> float:
    """Until when the capacity a preemption frees at `now` is held for its preemptor (`Hold.until`): through the
    queues' checkpoint grace, the time the preemption protocol itself allows a victim, at least MIN_HOLD_S. The
    scheduler service and the simulator hold it alike."""
    return now + max(float(checkpoint_grace_s), MIN_HOLD_S)


def priority_value(config: QueuesConfig, spec: JobSpec) -> int:
    """The job's priority under the configuration (the config's default class stands in for the built-in
    "normal"; an unknown class is 0), as admission and preemption read it."""
    classes = config.priority_class_map
    klass = classes.get(spec.priority_class)
    if klass is None and spec.priority_class == "normal" and config.default_priority_class:
        klass = classes.get(config.default_priority_class)
    return klass.value if klass is not None else 0


@dataclass(frozen=True)
class WaitingJob:
    """An admitted job waiting for placement."""

    spec: JobSpec
    allowed_models: tuple[str, ...]  # the flavors admission chose (empty = the job's own any-of list)
    priority: int
    admitted_at: float

    @property
    def job_id(self) -> str:
        return self.spec.job_id


def waiting_job(config: QueuesConfig, admitted: AdmittedWorkload) -> WaitingJob:
    return WaitingJob(spec=admitted.spec, allowed_models=tuple(sorted(set(admitted.flavors.values()))),
                      priority=priority_value(config, admitted.spec), admitted_at=admitted.admitted_at)


def placement_key(job: WaitingJob) -> tuple[int, float, str]:
    """The order admitted jobs are placed in: priority first (a high-priority job admitted later is not stuck
    behind a low one, nor backfilled around), then admission time, then id (deterministic)."""
    return (-job.priority, job.admitted_at, job.spec.job_id)


def asks_for_preemption(reason: str, priority: int, lowest_preemptible_running: int | None) -> bool:
    """Does an admitted job that could not be placed for `reason` ask for preemption? Only when preemption can
    cure the reason and some running preemptible job has strictly lower priority (the preemption core then
    applies every other rule: classes, protection window, lost work, guarantees)."""
    return reason in CURABLE and lowest_preemptible_running is not None and lowest_preemptible_running < priority


def admit(state: AdmissionState, now: float, *, explain: bool = True) -> AdmissionDecision:
    """Admission's half: quota, borrowing, fair share, priorities (the admission core), capped by quota only."""
    return admission_cycle(state, now, explain=explain)


@dataclass
class PlacementOutcome:
    result: CycleResult  # placements (committed on the index), reservations, unplaceable with reasons
    preemption_asks: list[str] = field(default_factory=list)  # job ids, in placement order


def place(cluster: ClusterIndex, waiting: Iterable[WaitingJob], running: Sequence[RunningJob], now: float, *,
          lowest_preemptible_running: int | None = None, backfill: bool = True,
          timeline: Sequence[tuple[float, str]] | None = None, holds: Sequence[Hold] = ()) -> PlacementOutcome:
    """The scheduler's half: place the admitted jobs in the pipeline's order (committed on `cluster`), reserve
    for blocked heads, backfill around them, and say which unplaced jobs ask for preemption. `timeline`: the
    running jobs' sorted (expected end, job id) when the caller keeps it (`schedule_cycle`). `holds`: capacity
    freed by preemptions, which only their preemptors may take (`schedule_cycle`): the freed GPUs go to the job
    that asked for them, not to whichever job comes first in the order."""
    order = sorted(waiting, key=placement_key)
    pending = [PendingJob(spec=w.spec, allowed_models=w.allowed_models) for w in order]
    priority = {w.spec.job_id: w.priority for w in order}
    return _place(cluster, pending, priority.__getitem__, running, now, lowest_preemptible_running, backfill,
                  timeline, holds)


def place_ordered(cluster: ClusterIndex, pending: Sequence[PendingJob], priority: Callable[[str], int],
                  timeline: Sequence[tuple[float, str]], now: float, *, lowest_preemptible_running: int | None = None,
                  backfill: bool = True, holds: Sequence[Hold] = ()) -> PlacementOutcome:
    """`place` for a caller that keeps its waiting jobs in the pipeline's order (`placement_key`) and the running
    timeline up to date itself (`PlacementBook`): the same decisions, without sorting either again.
    `priority(job_id)`: a waiting job's priority. The services do not resize running jobs yet: an elastic job is
    placed at its floor here (what admission charged), and grows and shrinks only in `decide`'s callers."""
    pending = [PendingJob(p.spec.at_pods(p.spec.min_pods), p.allowed_models) if p.spec.elastic else p
               for p in pending]
    return _place(cluster, pending, priority, (), now, lowest_preemptible_running, backfill, timeline, holds)


def _place(cluster: ClusterIndex, pending: Sequence[PendingJob], priority: Callable[[str], int],
           running: Sequence[RunningJob], now: float, lowest: int | None, backfill: bool,
           timeline: Sequence[tuple[float, str]] | None, holds: Sequence[Hold] = ()) -> PlacementOutcome:
    result = schedule_cycle(cluster, pending, running, now, backfill=backfill, timeline=timeline, holds=holds)
    # With no preemptible job running nobody asks (`asks_for_preemption`): skip the priorities then.
    asks = [] if lowest is None else [u.job_id for u in result.unplaceable
                                      if asks_for_preemption(u.reason, priority(u.job_id), lowest)]
    return PlacementOutcome(result, asks)


@dataclass
class CycleOutcome:
    admitted: list[WaitingJob]
    placement: PlacementOutcome
    admission: AdmissionDecision


def cycle(state: AdmissionState, cluster: ClusterIndex, waiting: Mapping[str, WaitingJob],
          running: Sequence[RunningJob], now: float, *, lowest_preemptible_running: int | None = None,
          backfill: bool = True, run_admission: bool = True,
          timeline: Sequence[tuple[float, str]] | None = None, holds: Sequence[Hold] = ()) -> CycleOutcome:
    """The whole pipeline once, on one snapshot: admit (when `run_admission`), then place every admitted job
    waiting (those in `waiting` and the ones just admitted). Applies the admissions to `state` and the
    placements to `cluster`; `waiting` is not changed (the caller keeps its own bookkeeping). `holds`: as for
    `place`."""
    decision = admit(state, now, explain=False) if run_admission else AdmissionDecision()
    admitted = [waiting_job(state.config, a) for a in decision.admitted]
    outcome = place(cluster, [*waiting.values(), *admitted], running, now,
                    lowest_preemptible_running=lowest_preemptible_running, backfill=backfill, timeline=timeline,
                    holds=holds)
    return CycleOutcome(admitted, outcome, decision)
