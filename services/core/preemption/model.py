"""Value types of the preemption core: who runs (possible victims), who asks (the preemptor), and decisions.

Everything is a frozen snapshot built by the caller (the service from its tables, the simulator from its
state); the core never reads a clock or a database.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from shared.config import QueuesConfig
from shared.domain import JobKind, JobSpec

PRIORITY = "PriorityPreemption"
RECLAIM = "ReclaimQuota"


class Why:
    """Machine reasons a running job is not a victim (stable strings: the CLI and explain print them)."""

    PRODUCTION = "ProductionClass"
    NOT_PREEMPTIBLE = "NotPreemptible"
    NOT_LOWER_PRIORITY = "NotLowerPriority"
    INFERENCE = "InferenceNotPreemptedByTraining"
    JUST_STARTED = "ProtectedJustStarted"
    NEAR_END = "ProtectedNearEnd"
    TOO_MUCH_LOST_WORK = "ProtectedUnsavedWork"
    WITHIN_QUEUE_NEVER = "WithinQueueNever"
    RECLAIM_NEVER = "ReclaimNever"
    RECLAIM_SAME_QUEUE = "ReclaimTakesFromOtherQueues"
    OTHER_COHORT = "DifferentCohort"
    NOT_BORROWING = "QueueWithinNominal"
    BEING_PREEMPTED = "AlreadyBeingPreempted"
    SELF = "IsThePreemptor"


class Outcome:
    """What became of a PreemptionRequested (recorded per request)."""

    STARTED = "started"
    NO_VICTIMS = "no_victims"
    DEFERRED = "deferred"  # no victim yet, only because candidates are protected: retried when that ends
    FITS = "fits_without_preemption"
    RATE_LIMITED = "rate_limited"
    COOLDOWN = "cooldown"  # the preemptor was itself preempted recently: retried when its cool-down ends
    DUPLICATE = "duplicate"
    NOT_WAITING = "preemptor_not_waiting"


@dataclass(frozen=True)
class RunningJob:
    """A job holding resources now, as a possible victim."""

    job_id: str
    queue: str
    priority_class: str
    priority: int
    preemptible: bool  # resolved: JobSpec.preemptible overrides the class
    production: bool  # production classes are never preempted, whatever the override says
    kind: JobKind
    gpus: float  # whole GPUs plus MIG slices as their fraction of a GPU (lost-work weight)
    usage: Mapping[str, int]  # quota resource (GPU model, or "<model>:<profile>") -> amount held
    started_at: float  # start of the current run (placement time until the executor reports the start)
    max_runtime_s: int
    last_checkpoint_at: float | None = None
    checkpointable: bool = False
    # With checkpoint-before-preempt a checkpointable victim is asked to save its state first, so what it
    # loses is at most the time that checkpoint takes, not the work since its last periodic checkpoint.
    # None = victims are evicted without a checkpoint request.
    checkpoint_cost_s: float | None = None

    @property
    def expected_end(self) -> float:
        return self.started_at + self.max_runtime_s

    def lost_gpu_seconds(self, now: float) -> float:
        """Work lost if preempted now: GPU-seconds since the last checkpoint of this run (or its start); when
        the protocol checkpoints first, at most the checkpoint's own duration."""
        since = self.started_at if self.last_checkpoint_at is None else max(self.started_at, self.last_checkpoint_at)
        lost = max(0.0, now - since)
        if self.checkpointable and self.checkpoint_cost_s is not None:
            lost = min(lost, self.checkpoint_cost_s)
        return self.gpus * lost


@dataclass(frozen=True)
class Preemptor:
    """A job that cannot get what it needs without taking it from running jobs."""

    job_id: str
    queue: str
    priority: int
    kind: JobKind
    spec: JobSpec
    reason: str  # PRIORITY or RECLAIM
    allowed_models: tuple[str, ...] = ()  # flavors admission chose (empty = the job's own any-of list)
    need: Mapping[str, int] = field(default_factory=dict)  # quota resource -> amount that must be freed
    # quota resource -> the part of `need` that must come from the preemptor's own queue (admission's
    # within-queue preemption, alone or with a reclaim in the same decision)
    own_need: Mapping[str, int] = field(default_factory=dict)
    # borrow_within_cohort, fair-sharing preemption: the preemptor borrows, so other queues' victims must have at
    # most this priority
    max_victim_priority: int | None = None
    # a reclaim: when its request was first asked (None: unknown). Victim selection may then wait for cheaper
    # victims that leave their protection window before `waiting_since + protection_window_s` (select.py)
    waiting_since: float | None = None

    @property
    def for_quota(self) -> bool:
        """Admission asked: the preemptor lacks quota (`need`), not room on the nodes, so victims must free
        `need` even when the preemptor would already fit on the nodes."""
        return bool(self.need) and (self.reason == RECLAIM or bool(self.own_need))


@dataclass(frozen=True)
class Selection:
    """The victims chosen for one preemptor (empty with `why` when there is no sufficient set)."""

    victims: tuple[str, ...]
    lost_gpu_seconds: float
    why: str = ""  # machine reason when `victims` is empty
    message: str = ""
    rejected: Mapping[str, str] = field(default_factory=dict)  # running job -> why it is not a candidate
    fits_checks: int = 0  # what-if placements evaluated (a cost figure for benchmarks)


def priority_of(config: QueuesConfig, spec: JobSpec) -> tuple[int, bool, bool]:
    """(priority value, preemptible, production) for a job under the configuration.

    Production = a non-preemptible class whose name starts with "prod" (the seed's `production`), or any
    class named so: such jobs are never victims, even if their spec says `preemptible: true`."""
    classes = config.priority_class_map
    klass = classes.get(spec.priority_class)
    if klass is None and spec.priority_class == "normal" and config.default_priority_class:
        klass = classes.get(config.default_priority_class)
    value = klass.value if klass is not None else 0
    class_preemptible = klass.preemptible if klass is not None else True
    production = spec.priority_class.startswith("prod")
    preemptible = class_preemptible if spec.preemptible is None else spec.preemptible
    return value, preemptible and not production, production


def usage_by_queue(running: list[RunningJob] | tuple[RunningJob, ...]) -> dict[str, dict[str, int]]:
    return summed_usage(sorted(running, key=by_job_id))


by_job_id = attrgetter("job_id")


def summed_usage(ordered: Iterable[RunningJob]) -> dict[str, dict[str, int]]:
    """`usage_by_queue` of jobs already in job id order (victim selection has them so, for every request)."""
    out: dict[str, dict[str, int]] = {}
    for job in ordered:
        q = out.get(job.queue)
        if q is None:
            q = out[job.queue] = {}
        usage = job.usage
        for r, amount in sorted(usage.items()) if len(usage) > 1 else usage.items():
            q[r] = q.get(r, 0) + amount
    return out
