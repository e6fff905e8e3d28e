"""The one decision loop: admission, placement and preemption decided on one snapshot, in one pass.

`decide` runs the pipeline's cycle (admit, then place in the pipeline's order, holds honoured) and, in the same
pass, on the snapshot those placements left, chooses the victims for every job it found unplaceable for a reason
a preemption can cure (`asks_for_preemption`) and for admission's reclaims (and within-queue preemptions), by the
preemption core's rules (`choose_victims`: classes and production, the protection window, the cool-down, the
hourly limit, the borrowers' guarantees). It returns one `Decision`: admissions, placements, preemptions (victim,
preemptor, reason, checkpoint first and its grace, lost GPU-seconds) and the reasons the others wait.

Callers apply it: the simulator's `gpuq` policy and the ETA's replay stop the victims, requeue them and decide
again in the same instant (the victims' capacity is held for their preemptors, `hold_until`); the services run
the checkpoint protocol on each preemption (docs/preemption.md).

A request is asked once (`ServiceAsks`: as the services' shells send PreemptionRequested; `ReplayAsks`: the ETA's
replay, which has no shells to mirror), and asked again when a request held back may be decided otherwise.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.core.admission import AdmissionState
from services.core.preemption import priority_of
from services.core.scheduler import ClusterIndex, Hold, RunningJob, Unplaceable
from shared.config import QueuesConfig
from shared.domain import JobSpec

from .elastic import ElasticPass, Resize
from .pipeline import CycleOutcome, WaitingJob, cycle
from .preempt import Preempted, PreemptionContext, RunningInfo, VictimChooser


@dataclass
class Decision(CycleOutcome):
    """A pass's decision: `admitted`, `placement` (placements, reservations, the unplaceable with their reasons)
    and `admission` as `cycle` gives them, and the preemptions chosen in the same pass."""

    preemptions: list[Preempted] = field(default_factory=list)
    # when a request held back (a protection window, a cool-down) is worth deciding again (None: none is)
    wake_at: float | None = None
    # running elastic jobs grown or shrunk in the pass (elastic.py), and elastic starts capped by quota
    resizes: list[Resize] = field(default_factory=list)

    @property
    def waiting_reasons(self) -> dict[str, tuple[str, str]]:
        """Every admitted job left waiting -> (reason, message)."""
        return {u.job_id: (u.reason, u.message) for u in self.placement.result.unplaceable}


class ServiceAsks:
    """Which requests a pass asks, as the services' shells send them: the scheduler asks for a job when its
    pending (reason, message) changes, not every cycle (forgotten when it is placed); admission sends a job's
    reclaim once (forgotten when the job stops running). All are asked again once the first request held back
    may be decided again (the chooser's `next_wake`), as the preemption service runs a deferred request again."""

    def __init__(self) -> None:
        self._published: dict[str, tuple[str, str]] = {}
        self._reclaims_sent: set[str] = set()
        self._resend_at: float | None = None

    def requests(self, out: CycleOutcome, now: float) -> tuple[list[Unplaceable], list[Any]]:
        if self._resend_at is not None and now >= self._resend_at:
            self._resend_at = None
            self._reclaims_sent.clear()
            self._published.clear()
        reclaims = [r for r in out.admission.reclaims if r.preemptor not in self._reclaims_sent]
        self._reclaims_sent.update(r.preemptor for r in reclaims)
        result = out.placement.result
        for p in result.placed:
            self._published.pop(p.job_id, None)
        wants = set(out.placement.preemption_asks)
        asks: list[Unplaceable] = []
        for u in result.unplaceable:
            key = (u.reason, u.message)
            if self._published.get(u.job_id) != key:
                self._published[u.job_id] = key
                if u.job_id in wants:
                    asks.append(u)
        return asks, reclaims

    def decided(self, next_wake: float | None, now: float) -> None:
        if next_wake is not None and (self._resend_at is None or next_wake < self._resend_at):
            self._resend_at = next_wake

    def stopped(self, job_id: str) -> None:
        self._reclaims_sent.discard(job_id)


class ReplayAsks:
    """Which requests a pass of the ETA's replay asks: each preemptor once, and again only after a request held
    back may be decided again (`wake_at`)."""

    def __init__(self) -> None:
        self.sent: set[str] = set()
        self._wake: float | None = None

    def requests(self, out: CycleOutcome, now: float) -> tuple[list[Unplaceable], list[Any]]:
        if self._wake is not None and now >= self._wake:
            self._wake = None
            self.sent.clear()
        wants = set(out.placement.preemption_asks)
        reclaims = [r for r in out.admission.reclaims if r.preemptor not in self.sent]
        asks = [u for u in out.placement.result.unplaceable if u.job_id in wants and u.job_id not in self.sent]
        self.sent.update(r.preemptor for r in reclaims)
        self.sent.update(u.job_id for u in asks)
        return asks, reclaims

    def decided(self, next_wake: float | None, now: float) -> None:
        if next_wake is not None and next_wake > now:
            self._wake = next_wake if self._wake is None else min(self._wake, next_wake)

    def stopped(self, job_id: str) -> None:
        pass

    def wake_at(self, now: float) -> float | None:
        """When a request held back is asked again (None: none is)."""
        return self._wake if self._wake is not None and self._wake > now else None


class PreemptionStage:
    """The preemption stage's memory across passes: the running jobs as preemption sees them (spec, start; every
    start and stop logged, for the chooser's incremental view), the lowest running preemptible priority, which
    requests were asked (`asks`) and the victim chooser with its guard rails. The caller reports what happens
    between passes (`stopped`: a job ended or was requeued); `decide` reports the pass's starts and victims."""

    def __init__(self, chooser: VictimChooser, asks: ServiceAsks | ReplayAsks) -> None:
        self.chooser = chooser
        self.asks = asks
        self.running: dict[str, RunningInfo] = {}
        self.log: list[str] = []  # job ids, each time one starts or stops running
        self._preemptible: dict[int, int] = {}  # priority -> how many preemptible jobs of it run

    @property
    def config(self) -> QueuesConfig:
        return self.chooser.config

    def started(self, job_id: str, spec: JobSpec, at: float) -> None:
        self.stopped(job_id, log=False)
        self.running[job_id] = RunningInfo(spec, at, at + spec.max_runtime_s)
        value, preemptible, _ = priority_of(self.config, spec)
        if preemptible:
            self._preemptible[value] = self._preemptible.get(value, 0) + 1
        self.log.append(job_id)

    def stopped(self, job_id: str, *, log: bool = True) -> None:
        if log:
            self.asks.stopped(job_id)
        info = self.running.pop(job_id, None)
        if info is None:
            return
        value, preemptible, _ = priority_of(self.config, info.spec)
        if preemptible:
            left = self._preemptible[value] - 1
            if left:
                self._preemptible[value] = left
            else:
                del self._preemptible[value]
        if log:
            self.log.append(job_id)

    def lowest_preemptible(self) -> int | None:
        """The lowest priority of a preemptible running job (an unplaceable job asks for preemption only above)."""
        return min(self._preemptible) if self._preemptible else None

    def choose(self, out: CycleOutcome, state: AdmissionState, cluster: ClusterIndex,
               waiting: Mapping[str, WaitingJob], now: float) -> list[Preempted]:
        """The pass's preemptions, on the snapshot its placements left (`cluster`, `state`)."""
        admitted = {w.job_id: w for w in out.admitted}
        for p in out.placement.result.placed:
            w = admitted.get(p.job_id) or waiting[p.job_id]
            self.started(p.job_id, w.spec, now)
        asks, reclaims = self.asks.requests(out, now)
        if not asks and not reclaims:
            return []
        policy = state.config.policy
        victims = self.chooser(PreemptionContext(
            now=now, cluster=cluster, admission=state, unplaceable=asks, reclaims=reclaims, running=self.running,
            protection_window_s=policy.protection_window_s, checkpoint_grace_s=policy.checkpoint_grace_s,
            running_log=self.log))
        self.asks.decided(self.chooser.next_wake, now)
        for v in victims:
            self.stopped(v.job_id)
        return victims


def decide(state: AdmissionState, cluster: ClusterIndex, waiting: Mapping[str, WaitingJob],
           running: Sequence[RunningJob], now: float, *, stage: PreemptionStage | None = None,
           lowest_preemptible_running: int | None = None, backfill: bool = True, run_admission: bool = True,
           timeline: Sequence[tuple[float, str]] | None = None, holds: Sequence[Hold] = (),
           elastic: Mapping[str, JobSpec] | None = None) -> Decision:
    """Admission, placement and preemption on one snapshot (the module docstring). Applies the admissions to
    `state` and the placements to `cluster` as `cycle` does; the victims are chosen on that snapshot but not
    released (the caller stops and requeues them, then decides again). Without a `stage` nothing is preempted.
    `lowest_preemptible_running`: the stage's own unless the caller keeps it. `elastic`: the running elastic jobs
    (by id, their specs), which the pass grows and shrinks before it preempts (elastic.py); None: elastic jobs
    start at what fits and keep their size."""
    if stage is not None and lowest_preemptible_running is None:
        lowest_preemptible_running = stage.lowest_preemptible()
    out = cycle(state, cluster, waiting, running, now, lowest_preemptible_running=lowest_preemptible_running,
                backfill=backfill, run_admission=run_admission, timeline=timeline, holds=holds)
    resized = _resize(state, cluster, out, waiting, elastic, bool(holds))
    if stage is None:
        return Decision(out.admitted, out.placement, out.admission, resizes=resized)
    victims = stage.choose(out, state, cluster, waiting, now)
    return Decision(out.admitted, out.placement, out.admission, victims, stage.chooser.next_wake, resized)


def _resize(state: AdmissionState, cluster: ClusterIndex, out: CycleOutcome, waiting: Mapping[str, WaitingJob],
            elastic: Mapping[str, JobSpec] | None, held: bool) -> list[Resize]:
    """The elastic steps (elastic.py) when the caller names its running elastic jobs or an elastic job was placed:
    a job placed with more pods than its floor is charged for them either way (quota charges what runs). A reclaim
    in a cohort where pods were given back waits for the next pass."""
    if elastic is None and not any(p.job_id in state.admitted and state.admitted[p.job_id].spec.elastic
                                   for p in out.placement.result.placed):
        return []
    every = {**waiting, **{w.job_id: w for w in out.admitted}}
    step = ElasticPass(state, cluster, elastic or {})
    resized = step.finish(out.placement.result, every, held=held)
    if step.gave_back and out.admission.reclaims:
        out.admission.reclaims = [r for r in out.admission.reclaims if not step.defers(r.queue)]
    return resized
