"""`gpuq`: the production pipeline, driven through the SAME pure pipeline core the services use.

Each cycle is `services.core.pipeline.decide`, the one decision loop: admission (the admission core: quotas,
borrowing, fair share, priorities, capped by quota only), placement of every admitted-but-unplaced job in the
pipeline's order (the scheduler core: gang, topology, binpack, backfill with reservations from `max_runtime_s`)
and, in the same pass, the victims of the jobs it found unplaceable and of admission's reclaims (the preemption
core's rules, `PreemptionStage`). No scheduling logic lives here: only the bookkeeping that the services' shells
do with events (a victim stopped and requeued, its capacity held for its preemptor, a decision again).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from services.core.pipeline import Preempted, PreemptionStage, RunningInfo, ServiceAsks, VictimChooser
from services.core.pipeline.elastic import SHRINK
from shared.config import QueuesConfig, placement_strategies
from shared.domain import JobSpec
from sim.elastic import ELASTIC, as_elastic, sizes
from sim.engine import CycleOutput
from sim.model import Trace, TraceJob


def cores_available() -> bool:
    try:
        import services.core.admission
        import services.core.scheduler  # noqa: F401
    except ImportError:
        return False
    return True


# How often the usage history is handed to admission (Slurm's PriorityCalcPeriod default: 5 minutes); the
# half-life of `gpuq-fairtime` is Slurm's PriorityDecayHalfLife default, 7 days (sim/run.py).
HISTORY_PERIOD_S = 300.0


# The preemption stage's victim chooser, made from the trace's queues at setup (None: nothing is preempted).
ChooserFactory = Callable[[QueuesConfig], VictimChooser]


class GpuqPolicy:
    name = "gpuq"

    def __init__(self, preemption: ChooserFactory | None = None, *, backfill: bool = True,
                 duration_aware: bool = False, history_half_life_s: float | None = None, defrag: bool = False,
                 elastic: str | None = None):
        self.preemption = preemption
        self.elastic_mode = elastic  # sim/elastic.py: None, or which twin of the elastic rule this policy replays
        # Defragmentation moves (services/core/pipeline/defrag.py): on when the queues' policy turns them on, or
        # for `gpuq-defrag` whatever the config says (with the config's bounds)
        self.defrag = defrag
        self.backfill = backfill
        # Duration-aware ordering: each arrival's GPU-time is predicted (services.core.pipeline.predict) from its
        # limit and the history of similar jobs that ended, the history the metering ledger keeps: the run time
        # this policy saw them take (starts and ends it reported), never the trace's true duration field.
        self.duration_aware = self._duration_asked = duration_aware
        # Fair share over time: per queue and quota resource, the GPU-seconds its running jobs used, decayed with
        # this half-life (what the metering ledger's history gives the admission service), handed to the
        # admission core every HISTORY_PERIOD_S of virtual time.
        self.history_half_life_s = self._half_life_asked = history_half_life_s

    def setup(self, trace: Trace) -> None:
        from services.core.admission import AdmissionState
        from services.core.scheduler import ClusterState

        self.trace = trace
        # The queues' own policy turns these on as it does in the services (a what-if of a production config);
        # `gpuq-duration` and `gpuq-fairtime` turn them on whatever the config says.
        policy = trace.queues.policy
        self.duration_aware = self._duration_asked or policy.duration_ordering
        self.history_half_life_s = self._half_life_asked
        if self.history_half_life_s is None and policy.usage_half_life_s is not None:
            self.history_half_life_s = float(policy.usage_half_life_s)
        self.adm = AdmissionState(trace.queues)
        # each queue's own placement strategy (queues.yaml `placement_strategy`), as the scheduler service sets it
        self.cluster = ClusterState.from_nodes(trace.nodes, queue_strategies=placement_strategies(trace.queues))
        # An empty copy answers "could this job ever be placed here?" at arrival: a job no empty cluster
        # can hold is refused (as the baselines refuse it) instead of being retried, and reserved for, forever.
        self._empty = ClusterState.from_nodes(trace.nodes)
        self._never: dict[tuple[object, ...], str] = {}
        self.submitted: dict[str, tuple[JobSpec, float]] = {}
        self.waiting: dict[str, Any] = {}  # admitted but not placed: job -> pipeline WaitingJob
        self.running: dict[str, RunningInfo] = {}
        self._running_jobs: dict[str, Any] = {}  # job_id -> scheduler RunningJob
        # their (expected end, job id), kept sorted for the scheduler (sorting them all again every cycle grew
        # with the cluster)
        self._timeline: list[tuple[float, str]] = []
        # job_id -> (priority, preemptible) of running jobs, for the pipeline's "asks for preemption" rule
        self._running_class: dict[str, tuple[int, bool]] = {}
        # priority -> how many preemptible jobs of it run: the lowest is read every cycle, and a scan of every
        # running job per cycle grew with the cluster
        self._preemptible_running: dict[int, int] = {}
        self.milli: dict[str, int] = {}
        self._allocated = 0
        self._pending_admission = 0
        self._down: dict[str, Any] = {}  # failed node -> its spec, restored when it comes back
        # The preemption stage of the decision loop: requests asked as the services' shells send them
        # (`ServiceAsks`), and asked again when a protection window or a cool-down that held one back ends
        # (reclaiming nominal quota must succeed within the protection window)
        self.stage = self._stage(trace.queues) if self.preemption is not None else None
        from services.core.pipeline.predict import DurationPredictor

        self.predictor = DurationPredictor()
        from sim.history import DecayedUsage

        self.usage_history = DecayedUsage(self.history_half_life_s or 1.0)
        self._next_history = 0.0
        self._held: dict[str, list[tuple[str, float]]] = {}  # running job -> (queue\x1fresource, GPUs) it holds
        self.predicted: dict[str, float] = {}  # job -> predicted GPU-seconds given to admission (kept: tests read it)
        self._ran: dict[str, float] = {}  # job -> seconds run in earlier runs (before preemptions / failures)
        # victim -> the capacity its preemption freed, held for its preemptor as the scheduler service holds it
        # (until the preemptor is placed, or for the checkpoint grace): the same `holds` of the pipeline core
        self._holds: dict[str, Any] = {}
        self.elastic_jobs: dict[str, JobSpec] = {}  # running elastic jobs (the decision loop grows and shrinks them)
        self._short: dict[str, int] = {}  # running elastic job -> milli-GPUs of the pods it runs without
        self._regrow = False  # capacity freed while elastic jobs run: a cycle may grow them

    def _stage(self, queues: QueuesConfig) -> PreemptionStage:
        """The decision loop's preemption stage, with defragmentation when the queues or `defrag` ask for it."""
        from services.core.pipeline.defrag import Defragmenter, DefragmentingStage, preemption_stage

        assert self.preemption is not None
        chooser = self.preemption(queues)
        if not self.defrag:
            return preemption_stage(chooser, ServiceAsks())
        settings = queues.policy.defragmentation.model_copy(update={"enabled": True})
        return DefragmentingStage(chooser, ServiceAsks(), Defragmenter(
            queues, settings, checkpoint_write_s=chooser.checkpoint_write_s))

    # -- engine hooks
    def on_arrival(self, job: TraceJob, now: float) -> str | None:
        from services.core.admission import Workload
        from services.core.scheduler import Unplaceable

        job = as_elastic(job, self.elastic_mode)
        spec = job.spec()
        shape = (job.pods, job.gpus_per_pod, job.mig_profile, job.gpu_models, job.cpu_milli, job.memory_mib,
                 job.preferred_level)
        never = self._never.get(shape)
        if never is None:  # one query per distinct gang shape, not per job
            got = self._empty.place(spec)
            never = self._never[shape] = got.reason if isinstance(got, Unplaceable) else ""
        if never:
            return f"Unschedulable:{never}"
        predicted = self._predict(spec, self.trace.gpu_milli(job) / 1000) if self.duration_aware else None
        rejection = self.adm.submit(Workload(spec=spec, submitted_at=now, predicted_gpu_s=predicted))
        if rejection is not None:
            return rejection.reason
        self.submitted[job.job_id] = (spec, now)
        self.milli[job.job_id] = self.trace.gpu_milli(job)
        self._pending_admission += 1
        return None

    def _predict(self, spec: JobSpec, gpus: float) -> float:
        from services.core.pipeline.predict import JobKey

        median = self.predictor.predict(JobKey.of(spec), float(spec.max_runtime_s)).median_s
        self.predicted[spec.job_id] = median * gpus
        return median * gpus

    def on_completion(self, job_id: str, now: float) -> None:
        if self.duration_aware:
            from services.core.pipeline.predict import JobKey

            info = self.running.get(job_id)
            if info is not None:  # what the ledger knows: the run times it recorded, summed over the job's runs
                ran = self._ran.pop(job_id, 0.0) + (now - info.started_at)
                self.predictor.observe(JobKey.of(info.spec), float(info.spec.max_runtime_s), ran)
        self._release_history(job_id, now)
        self._forget_class(job_id)
        if self.stage is not None:
            self.stage.stopped(job_id)
        self.cluster.release(job_id)
        self.adm.finish(job_id)
        self.running.pop(job_id, None)
        self._stop_running(job_id)
        self.submitted.pop(job_id, None)
        self._allocated -= self.milli.pop(job_id, 0) - self._short.pop(job_id, 0)
        self.elastic_jobs.pop(job_id, None)
        self._regrow = bool(self.elastic_jobs)

    def cycle(self, now: float) -> CycleOutput:
        from services.core.pipeline import decide

        if not self._pending_admission and not self.waiting and not self._regrow:
            return CycleOutput()
        self._regrow = False
        if self.history_half_life_s and now >= self._next_history:
            self._feed_history(now)
        lowest = min(self._preemptible_running) if self._preemptible_running else None
        if self._holds:
            self._holds = {v: h for v, h in self._holds.items() if h.until > now}
        # Expected ends come from estimates; an overrunning job's end is in the past, which the scheduler
        # reads as "ends any moment" (Slurm does the same). RunningJob objects are made once per start.
        out = decide(self.adm, self.cluster, self.waiting, list(self._running_jobs.values()), now, stage=self.stage,
                     lowest_preemptible_running=lowest, backfill=self.backfill,
                     run_admission=bool(self._pending_admission), timeline=self._timeline,
                     holds=tuple(self._holds.values()),
                     elastic=self.elastic_jobs if self.elastic_mode == ELASTIC else None)
        self._pending_admission -= len(out.admitted)
        for w in out.admitted:
            self.waiting[w.job_id] = w
        started = self._start(out.placement.result.placed, now)
        sized = self._sized(out)
        # The decision's preemptions: each victim stops and goes back to admission; its capacity is held for its
        # preemptor (as the scheduler service holds it on JobPreempted)
        victims = out.preemptions
        grace = self.trace.queues.policy.checkpoint_grace_s
        for v in victims:
            self._hold_for(v, now, grace)
            self._requeue(v.job_id, now)
        # a request that found only protected borrowers (or a cooling-down preemptor) is decided again then
        wake = out.wake_at
        # pods above a floor given back for a job waiting for admission: it is admitted now, as after a preemption
        gave_back = any(r.reason == SHRINK and r.for_job is None for r in out.resizes)
        if victims or gave_back:
            # the victims' GPUs are free in this instant (the checkpoint is folded into it): admit and place
            # their preemptors now, as the services do when JobPreempted arrives
            again = self.cycle(now)
            started = [j for j in started + again.started if j in self.running]
            sized = {j: n for j, n in {**sized, **again.sizes}.items() if j in self.running}
            victims = victims + again.preempted
            wake = again.wake_at if wake is None or (again.wake_at is not None and again.wake_at < wake) else wake
        if self._holds:  # a hold that expires unused frees its capacity for the others: a cycle then
            first = min(h.until for h in self._holds.values())
            wake = first if wake is None or first < wake else wake
        return CycleOutput(started=started, preempted=victims, wake_at=wake, sizes=sized)

    def _sized(self, out: Any) -> dict[str, tuple[int, int]]:
        """The elastic starts with fewer pods than their most and the resizes, for the engine; the milli-GPUs
        they hold follow."""
        if not self.elastic_jobs:
            return {}
        found = sizes(out.placement.result.placed, out.resizes, self.elastic_jobs)
        for job_id, (pods, of) in found.items():
            short = self.milli[job_id] * (of - pods) // of
            self._allocated -= short - self._short.get(job_id, 0)
            self._short[job_id] = short
        return found

    def _start(self, placed: Any, now: float) -> list[str]:
        """The decision's placements start running (each with its expected end on the timeline)."""
        from services.core.preemption import priority_of
        from services.core.scheduler import RunningJob

        started: list[str] = []
        if self._holds and placed:
            ids = {p.job_id for p in placed}
            self._holds = {v: h for v, h in self._holds.items() if h.preemptor not in ids}
        for placement in placed:
            job_id = placement.job_id
            w = self.waiting.pop(job_id)
            self.running[job_id] = RunningInfo(w.spec, now, now + w.spec.max_runtime_s)
            self._running_jobs[job_id] = RunningJob(job_id=job_id, expected_end=now + w.spec.max_runtime_s)
            bisect.insort(self._timeline, (now + w.spec.max_runtime_s, job_id))
            value, preemptible, _ = priority_of(self.trace.queues, w.spec)
            self._running_class[job_id] = (value, preemptible)
            if preemptible:
                self._preemptible_running[value] = self._preemptible_running.get(value, 0) + 1
            self._allocated += self.milli[job_id]
            if w.spec.elastic:
                self.elastic_jobs[job_id] = w.spec
            started.append(job_id)
            if self.history_half_life_s:
                admitted = self.adm.admitted.get(job_id)
                held = [(f"{w.spec.queue}\x1f{r}", float(n)) for r, n in sorted(admitted.usage.items())] \
                    if admitted is not None else []
                for account, n in held:
                    self.usage_history.hold(account, n, now)
                self._held[job_id] = held
        return started

    def _hold_for(self, victim: Preempted, now: float, grace_s: float) -> None:
        """The victim's capacity is held for its preemptor, as services/scheduler/app.py holds it on JobPreempted."""
        from services.core.pipeline import hold_until
        from services.core.scheduler import Hold
        from services.core.scheduler.types import HINT_HOLD

        placement = self.cluster.placement_of(victim.job_id)
        if victim.preemptor is None or placement is None or victim.preemptor.startswith("drain:"):
            return
        self._holds[victim.job_id] = Hold(preemptor=victim.preemptor, victim=victim.job_id, placement=placement,
                                          until=hold_until(now, grace_s))
        hint = getattr(victim, "hint", None)  # a defragmentation move (defrag.Moved): its holes are held for it
        if hint is not None:
            key = HINT_HOLD + victim.job_id  # as services/scheduler/defrag.py keys it
            self._holds[key] = Hold(preemptor=victim.job_id, victim=key, placement=hint, until=hold_until(now, grace_s))

    def _stop_running(self, job_id: str) -> None:
        job = self._running_jobs.pop(job_id, None)
        if job is not None:
            entry = (job.expected_end, job_id)
            i = bisect.bisect_left(self._timeline, entry)
            assert self._timeline[i] == entry, f"{job_id} missing from the running timeline"
            del self._timeline[i]

    def _forget_class(self, job_id: str) -> None:
        found = self._running_class.pop(job_id, None)
        if found is not None and found[1]:
            left = self._preemptible_running[found[0]] - 1
            if left:
                self._preemptible_running[found[0]] = left
            else:
                del self._preemptible_running[found[0]]

    def _feed_history(self, now: float) -> None:
        assert self.history_half_life_s is not None
        self.usage_history.advance(now)
        decayed: dict[str, dict[str, float]] = {}
        for key, value in sorted(self.usage_history.usage.items()):
            queue, resource = key.split("\x1f", 1)
            decayed.setdefault(queue, {})[resource] = value
        self.adm.set_usage_history(decayed, self.history_half_life_s)
        self._next_history = now + HISTORY_PERIOD_S

    def _release_history(self, job_id: str, now: float) -> None:
        for key, n in self._held.pop(job_id, []):
            self.usage_history.hold(key, -n, now)

    def _requeue(self, job_id: str, now: float) -> None:
        from services.core.admission import Workload

        info = self.running.pop(job_id, None)
        if info is None:
            return
        self._stop_running(job_id)
        self._forget_class(job_id)
        if self.stage is not None:
            self.stage.stopped(job_id)
        self.cluster.release(job_id)
        self.adm.finish(job_id)
        self._ran[job_id] = self._ran.get(job_id, 0.0) + (now - info.started_at)
        self._release_history(job_id, now)
        spec, submitted_at = self.submitted[job_id]
        self.adm.requeue(Workload(spec=spec, submitted_at=submitted_at, predicted_gpu_s=self.predicted.get(job_id)))
        self._allocated -= self.milli[job_id] - self._short.pop(job_id, 0)
        self.elastic_jobs.pop(job_id, None)
        self._pending_admission += 1

    def on_node_down(self, node: str, now: float) -> list[str]:
        from shared.domain import NodeHealth

        if node in self._down:
            return []
        killed = sorted(j for j, p in self.cluster.allocations().items() if any(b.node == node for b in p.bindings))
        for job_id in killed:
            self._requeue(job_id, now)  # back to admission with its original submit time, as after a preemption
        spec = self.cluster.node(node)
        self._down[node] = spec
        self.cluster.upsert_node(spec.model_copy(update={"health": NodeHealth.FAILED}))
        return killed

    def on_node_up(self, node: str, now: float) -> None:
        spec = self._down.pop(node, None)
        if spec is not None:
            self.cluster.upsert_node(spec)

    def allocated_milli(self) -> int:
        return self._allocated

    def fragmentation(self) -> int:
        from services.core.scheduler import fragmentation

        waiting = [w.spec for _, w in sorted(self.waiting.items())]
        # the first 200 of the jobs not yet admitted, in job id order (filtered before sorting: a deep backlog)
        waiting += [self.submitted[job_id][0] for job_id in sorted(
            j for j in self.submitted if j not in self.running and j not in self.waiting)[:200]]
        return int(fragmentation(self.cluster, waiting)) if waiting else 0
