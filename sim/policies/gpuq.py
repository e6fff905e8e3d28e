"""`gpuq`: the production pipeline, driven through the SAME pure cores the services use.

Each cycle: (1) admission — `services.admission.core.admission_cycle` (quotas, borrowing, fair share,
priorities) capped by the free GPUs per model; (2) placement — `services.scheduler.core.schedule_cycle` over
the admitted-but-unplaced jobs (gang, topology, binpack, backfill with reservations from `max_runtime_s`);
(3) preemption — a hook called when admitted jobs cannot be placed or admission asks to reclaim quota.
No scheduling logic lives here: only the bookkeeping that the services' shells do with events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shared.domain import JobSpec
from sim.engine import CycleOutput, Preempted
from sim.model import Trace, TraceJob


def cores_available() -> bool:
    try:
        import services.admission.core
        import services.scheduler.core  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class RunningInfo:
    spec: JobSpec
    started_at: float
    expected_end: float  # started_at + max_runtime_s: what the schedulers believe


@dataclass(frozen=True)
class PreemptionContext:
    """What a preemption core needs to pick victims: the snapshot after this cycle's placements."""

    now: float
    cluster: Any  # services.scheduler.core.ClusterState (do not mutate: return victims instead)
    admission: Any  # services.admission.core.AdmissionState
    unplaceable: Sequence[Any]  # scheduler Unplaceable of admitted jobs still waiting, in order
    reclaims: Sequence[Any]  # admission ReclaimRequest list of this cycle
    running: dict[str, RunningInfo]
    protection_window_s: int
    checkpoint_grace_s: int


PreemptionHook = Callable[[PreemptionContext], list[Preempted]]


def no_preemption(ctx: PreemptionContext) -> list[Preempted]:
    """The hook until the preemption core lands: never preempts (preemptions and lost work stay 0)."""
    return []


class GpuqPolicy:
    name = "gpuq"

    def __init__(self, preemption_hook: PreemptionHook = no_preemption, *, backfill: bool = True):
        self.preemption_hook = preemption_hook
        self.backfill = backfill

    def setup(self, trace: Trace) -> None:
        from services.admission.core import AdmissionState
        from services.scheduler.core import ClusterState

        self.trace = trace
        self.adm = AdmissionState(trace.queues)
        self.cluster = ClusterState.from_nodes(trace.nodes)
        # An empty copy answers "could this job ever be placed here?" at arrival: a job no empty cluster
        # can hold is refused (as the baselines refuse it) instead of being retried, and reserved for, forever.
        self._empty = ClusterState.from_nodes(trace.nodes)
        self._never: dict[tuple[object, ...], str] = {}
        self.prio = {p.name: p.value for p in trace.queues.priority_classes}
        self.submitted: dict[str, tuple[JobSpec, float]] = {}
        # admitted but not placed: job -> ((-priority, admission seq), AdmittedWorkload)
        self.waiting: dict[str, tuple[tuple[int, int], Any]] = {}
        self.running: dict[str, RunningInfo] = {}
        self._running_jobs: dict[str, Any] = {}  # job_id -> scheduler RunningJob
        self.milli: dict[str, int] = {}
        self._allocated = 0
        # Free MIG slices per admission resource "<model>:<profile>", kept here from placements so the
        # capacity cap passed to admission covers slices too (the scheduler reports whole GPUs per model).
        self._slices_free: dict[str, int] = {}
        for n in trace.nodes:
            if n.mig is not None and n.health == "ready":
                key = f"{n.gpu_model}:{n.mig.profile}"
                self._slices_free[key] = self._slices_free.get(key, 0) + n.gpus * n.mig.slices_per_gpu
        self._slice_usage: dict[str, dict[str, int]] = {}
        self._admit_seq = 0
        self._pending_admission = 0
        self._down: dict[str, Any] = {}  # failed node -> its spec, restored when it comes back

    # -- engine hooks
    def on_arrival(self, job: TraceJob, now: float) -> str | None:
        from services.admission.core import Workload
        from services.scheduler.core import Unplaceable

        spec = job.spec()
        shape = (job.pods, job.gpus_per_pod, job.mig_profile, job.gpu_models, job.cpu_milli, job.memory_mib,
                 job.preferred_level)
        never = self._never.get(shape)
        if never is None:  # one query per distinct gang shape, not per job
            got = self._empty.place(spec)
            never = self._never[shape] = got.reason if isinstance(got, Unplaceable) else ""
        if never:
            return f"Unschedulable:{never}"
        rejection = self.adm.submit(Workload(spec=spec, submitted_at=now))
        if rejection is not None:
            return rejection.reason
        self.submitted[job.job_id] = (spec, now)
        self.milli[job.job_id] = self.trace.gpu_milli(job)
        self._pending_admission += 1
        return None

    def _free_slices(self, job_id: str) -> None:
        for k, v in self._slice_usage.pop(job_id, {}).items():
            self._slices_free[k] += v

    def on_completion(self, job_id: str, now: float) -> None:
        self._free_slices(job_id)
        self.cluster.release(job_id)
        self.adm.finish(job_id)
        self.running.pop(job_id, None)
        self._running_jobs.pop(job_id, None)
        self.submitted.pop(job_id, None)
        self._allocated -= self.milli.pop(job_id, 0)

    def cycle(self, now: float) -> CycleOutput:
        from services.admission.core import admission_cycle
        from services.scheduler.core import PendingJob, RunningJob, schedule_cycle

        reclaims: Sequence[Any] = ()
        # 1. admission (only when someone waits for it)
        if self._pending_admission:
            decision = admission_cycle(self.adm, now,
                                       capacity={**self.cluster.free_gpus_by_model(), **self._slices_free})
            for a in decision.admitted:
                job_id = a.spec.job_id
                self.waiting[job_id] = ((-self.prio.get(a.spec.priority_class, 0), self._admit_seq), a)
                self._admit_seq += 1
            self._pending_admission -= len(decision.admitted)
            reclaims = decision.reclaims
            # Jobs the admission core cannot ever admit are refused at submit(); pending statuses of the
            # rest are not scanned here (O(pending) per cycle), only the ETA/explain paths need them.
        if not self.waiting:
            return CycleOutput()
        # 2. placement: admitted jobs in (priority, admission) order; reservations from estimates
        order = sorted(self.waiting.items(), key=lambda kv: kv[1][0])
        pending = [PendingJob(spec=a.spec, allowed_models=tuple(sorted(set(a.flavors.values()))))
                   for _, (_, a) in order]
        # Expected ends come from estimates; an overrunning job's end is in the past, which the scheduler
        # reads as "ends any moment" (Slurm does the same). RunningJob objects are made once per start.
        result = schedule_cycle(self.cluster, pending, list(self._running_jobs.values()), now,
                                backfill=self.backfill)
        started: list[str] = []
        for placement in result.placed:
            job_id = placement.job_id
            _, a = self.waiting.pop(job_id)
            self.running[job_id] = RunningInfo(a.spec, now, now + a.spec.max_runtime_s)
            self._running_jobs[job_id] = RunningJob(job_id=job_id, expected_end=now + a.spec.max_runtime_s)
            self._allocated += self.milli[job_id]
            slices = {k: v for k, v in a.usage.items() if k in self._slices_free}
            if slices:
                self._slice_usage[job_id] = slices
                for k, v in slices.items():
                    self._slices_free[k] -= v
            started.append(job_id)
        # 3. preemption hook: admitted work that cannot be placed, or a queue reclaiming its quota
        victims: list[Preempted] = []
        if result.unplaceable or reclaims:
            policy = self.trace.queues.policy
            ctx = PreemptionContext(now=now, cluster=self.cluster, admission=self.adm,
                                    unplaceable=result.unplaceable, reclaims=reclaims, running=self.running,
                                    protection_window_s=policy.protection_window_s,
                                    checkpoint_grace_s=policy.checkpoint_grace_s)
            victims = self.preemption_hook(ctx)
            for v in victims:
                self._requeue(v.job_id)
        return CycleOutput(started=started, preempted=victims)

    def _requeue(self, job_id: str) -> None:
        from services.admission.core import Workload

        info = self.running.pop(job_id, None)
        if info is None:
            return
        self._running_jobs.pop(job_id, None)
        self._free_slices(job_id)
        self.cluster.release(job_id)
        self.adm.finish(job_id)
        spec, submitted_at = self.submitted[job_id]
        self.adm.requeue(Workload(spec=spec, submitted_at=submitted_at))
        self._allocated -= self.milli[job_id]
        self._pending_admission += 1

    def on_node_down(self, node: str, now: float) -> list[str]:
        from shared.domain import NodeHealth

        if node in self._down:
            return []
        killed = sorted(j for j, p in self.cluster.allocations().items() if any(b.node == node for b in p.bindings))
        for job_id in killed:
            self._requeue(job_id)  # back to admission with its original submit time, as after a preemption
        spec = self.cluster.node(node)
        self._down[node] = spec
        self.cluster.upsert_node(spec.model_copy(update={"health": NodeHealth.FAILED}))
        if spec.mig is not None:  # its slices (all free now) leave the capacity admission may use
            key = f"{spec.gpu_model}:{spec.mig.profile}"
            self._slices_free[key] = self._slices_free.get(key, 0) - spec.gpus * spec.mig.slices_per_gpu
        return killed

    def on_node_up(self, node: str, now: float) -> None:
        spec = self._down.pop(node, None)
        if spec is not None:
            self.cluster.upsert_node(spec)
            if spec.mig is not None:
                key = f"{spec.gpu_model}:{spec.mig.profile}"
                self._slices_free[key] = self._slices_free.get(key, 0) + spec.gpus * spec.mig.slices_per_gpu

    def allocated_milli(self) -> int:
        return self._allocated

    def fragmentation(self) -> int:
        from services.scheduler.core import fragmentation

        waiting = [a.spec for _, (_, a) in sorted(self.waiting.items())]
        waiting += [spec for job_id, (spec, _) in sorted(self.submitted.items())
                    if job_id not in self.running and job_id not in self.waiting][:200]
        return int(fragmentation(self.cluster, waiting)) if waiting else 0
