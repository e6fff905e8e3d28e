"""Values the admission core takes and returns. Frozen so callers (the service adapter, the simulator, the ETA
forward simulation) can keep them without defensive copies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.domain import JobSpec


class Reason:
    """Machine reasons. Rejections happen at submit; `Waiting…`/`Inadmissible…` are statuses of pending jobs."""

    # rejections (JobRejected)
    UNKNOWN_QUEUE = "UnknownQueue"
    UNAUTHORIZED = "Unauthorized"
    UNKNOWN_PRIORITY_CLASS = "UnknownPriorityClass"
    NO_FLAVOR = "InadmissibleNoFlavor"
    EXCEEDS_LIMITS = "InadmissibleExceedsLimits"
    DUPLICATE_JOB_ID = "DuplicateJobId"
    # pending, admissible in principle
    WAITING_FOR_QUOTA = "WaitingForQuota"
    WAITING_FOR_BORROWABLE_QUOTA = "WaitingForBorrowableQuota"
    WAITING_FOR_RECLAIM = "WaitingForReclaim"
    WAITING_FOR_PREEMPTION = "WaitingForPreemption"  # its queue's lower-priority jobs are asked to make room
    WAITING_FOR_CAPACITY = "WaitingForCapacity"
    WAITING_FOR_MAX_RUNNING_JOBS = "WaitingForMaxRunningJobs"
    WAITING_IN_STRICT_FIFO = "WaitingInStrictFIFO"
    WAITING_FOR_NEXT_CYCLE = "WaitingForNextCycle"
    QUEUE_HELD = "WaitingForQueueHeld"  # the queue's stop_policy is Hold
    # pending but inadmissible under the current configuration (after a config change or a requeue)
    QUEUE_DELETED = "InadmissibleQueueDeleted"
    INADMISSIBLE_UNAUTHORIZED = "InadmissibleUnauthorized"
    INADMISSIBLE_UNKNOWN_PRIORITY_CLASS = "InadmissibleUnknownPriorityClass"

    # ReclaimRequest.reason, as carried by PreemptionRequested
    RECLAIM_QUOTA = "ReclaimQuota"  # takes from other queues' borrowers (and maybe its own queue: own_need)
    PRIORITY_PREEMPTION = "PriorityPreemption"  # takes only from its own queue's lower-priority jobs


@dataclass(frozen=True)
class Workload:
    spec: JobSpec
    submitted_at: float  # original submit time, kept on requeue so a preempted job keeps its place
    # Predicted GPU-seconds (services.core.pipeline.predict; never the true duration): with it, jobs of equal
    # priority and fair-share standing go shortest first, with aging (core/ordering.py). None: FIFO.
    predicted_gpu_s: float | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id


@dataclass(frozen=True)
class AdmittedWorkload:
    spec: JobSpec
    submitted_at: float
    admitted_at: float
    flavors: dict[str, str]  # pod set name -> gpu model (pod sets that ask for no GPU are absent)
    usage: dict[str, int]  # quota resource -> amount reserved: GPUs of "<model>", or slices of "<model>:<profile>"
    borrowing: bool
    # the node pool admission chose from its queue's `pools` (`spec` then selects it); None: it chose none
    pool: str | None = None

    @property
    def job_id(self) -> str:
        return self.spec.job_id


@dataclass(frozen=True)
class Rejection:
    job_id: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PendingStatus:
    job_id: str
    queue: str
    reason: str
    message: str
    position_in_queue: int  # 1-based, in the queue's order (priority, then submit time)
    position_in_cohort: int  # 1-based, among the cohort's pending jobs in the same order (= queue position alone)


@dataclass(frozen=True)
class ReclaimRequest:
    preemptor: str  # the pending job that fits its queue's nominal quota but not what borrowers left
    queue: str
    need: dict[str, int]  # resource -> amount that must be freed
    candidates: tuple[str, ...]  # victims' job ids, lowest priority first, then most recently admitted
    reason: str = Reason.RECLAIM_QUOTA
    # resource -> amount of `need` that must come from the preemptor's own queue (its lower-priority jobs):
    # within-queue preemption, alone (reason PriorityPreemption) or with a reclaim in the same decision
    own_need: dict[str, int] = field(default_factory=dict)
    # borrow_within_cohort: the preemptor borrows, so victims must have a priority below its own and at most this
    max_victim_priority: int | None = None


@dataclass
class AdmissionDecision:
    admitted: list[AdmittedWorkload] = field(default_factory=list)
    # job_id -> status; the cycle sets a PendingStatuses view (computed when read, valid until the state changes)
    pending: Mapping[str, PendingStatus] = field(default_factory=dict)
    reclaims: list[ReclaimRequest] = field(default_factory=list)


@dataclass(frozen=True)
class QueueSummary:
    """One row of `gpuq queues`."""

    queue: str
    cohort: str | None
    weight: float
    strategy: str
    nominal: dict[str, int]
    used: dict[str, int]
    borrowed: dict[str, int]  # usage above nominal, per resource
    lent: dict[str, int]  # share of the cohort's borrowing attributed to this queue's unused lendable quota
    pending: int
    inadmissible: int  # pending jobs that cannot be admitted under the current config
    running: int  # admitted jobs (quota reserved)
    max_running_jobs: int | None
    oldest_wait_s: float | None  # now - submit time of the oldest pending job; None when none pend


@dataclass(frozen=True)
class QueueFacts:
    """What a `gpuq queues` row says of a queue, without the clock: the submit time of its oldest pending job
    instead of how long it has waited. Admission publishes these (services/admission/queuemodel.py); a reader
    turns them into its row at its own `now`."""

    queue: str
    cohort: str | None
    weight: float
    strategy: str
    nominal: dict[str, int]
    used: dict[str, int]
    borrowed: dict[str, int]
    lent: dict[str, int]
    pending: int
    inadmissible: int
    running: int
    max_running_jobs: int | None
    oldest_submitted_at: float | None  # None when none pend

    def at(self, now: float) -> QueueSummary:
        """The row as of `now`."""
        return QueueSummary(
            queue=self.queue, cohort=self.cohort, weight=self.weight, strategy=self.strategy, nominal=self.nominal,
            used=self.used, borrowed=self.borrowed, lent=self.lent, pending=self.pending,
            inadmissible=self.inadmissible, running=self.running, max_running_jobs=self.max_running_jobs,
            oldest_wait_s=None if self.oldest_submitted_at is None else max(0.0, now - self.oldest_submitted_at))
