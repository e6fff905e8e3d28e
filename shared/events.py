"""The event catalogue: pydantic payload models, the CloudEvents 1.0 envelope, and the type registry.

Each payload class declares its `aggregate` and `fact`; from them follow the CloudEvents type
`io.gpuq.<aggregate>.<fact>.v1` and the NATS subject `<namespace>.<aggregate>.<fact>` (namespace `gpuq` by
default, see shared/namespace.py). Within v1 only
additive, optional changes are allowed: `tests/unit/test_event_schemas.py` compares every model's JSON
Schema with the committed file under `shared/schemas/`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from itertools import accumulate
from typing import Any, ClassVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import from_json, to_json

from shared import namespace
from shared.domain import (
    MAX_STRING_CHARS,
    STRINGS_CHECKED,
    GpuBinding,
    JobSpec,
    NodeSpec,
    Precision,
    refuse_unstorable,
    shown,
    unset,
    unstorable,
)

SPEC_VERSION = "1.0"
TYPE_PREFIX = "io.gpuq."
# A team or service name as one subject token (no '.', '*', '>' or whitespace).
SCOPE_TOKEN_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,62}[a-z0-9])?$")


class Payload(BaseModel):
    """Base of every event payload. Unknown fields are ignored so that additive v1 changes stay compatible."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    aggregate: ClassVar[str]
    fact: ClassVar[str]
    version: ClassVar[int] = 1
    # Events whose subject carries one more token naming who may publish them (`<ns>.job.submitted.<team>`):
    # NATS permissions grant that subject to one credential, so consumers take the team (or the recording
    # service) from the subject, never from the payload. None: the plain subject.
    scope: ClassVar[str | None] = None
    # The subject family an event travels in, when not its aggregate's: "status" for the news about a waiting job
    # (JobPending), read by telemetry, the API and webhooks but by no decision service, which therefore never
    # receives it (`<ns>.status.job.pending`, in its own stream).
    channel: ClassVar[str | None] = None

    @classmethod
    def event_type(cls) -> str:
        return f"{TYPE_PREFIX}{cls.aggregate}.{cls.fact}.v{cls.version}"

    @classmethod
    def subject(cls) -> str:
        """The NATS subject in this process's platform namespace (`gpuq.<aggregate>.<fact>` by default)."""
        channel = f"{cls.channel}." if cls.channel else ""
        return f"{namespace.current()}.{channel}{cls.aggregate}.{cls.fact}"

    @classmethod
    def subscription(cls) -> str:
        """What consumers filter on: the subject, with a wildcard for the scope token of scoped events."""
        return cls.subject() + (".*" if cls.scope else "")

    @classmethod
    def scoped_subject(cls, token: str) -> str:
        """The subject a scoped event is published on: `<ns>.job.submitted.team-a`."""
        if not cls.scope:
            raise TypeError(f"{cls.__name__} is not scoped: publish it on {cls.subject()}")
        if not SCOPE_TOKEN_RE.match(token):
            raise ValueError(f"{token!r} cannot be a subject token ({cls.scope})")
        return f"{cls.subject()}.{token}"

    @classmethod
    def scope_of(cls, subject: str) -> str | None:
        """The scope token of a subject this event type may travel on; None when the subject does not fit the
        type (a `JobPlaced` body on a submission subject, a submission without its team token)."""
        base = cls.subject()
        if not cls.scope:
            return "" if subject == base else None
        token = subject.removeprefix(base + ".") if subject.startswith(base + ".") else ""
        return token if token and SCOPE_TOKEN_RE.match(token) else None

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any, info: ValidationInfo) -> Any:
        # Strings Postgres cannot store (shared.domain.unstorable) are refused in every payload made here;
        # parse_event checks a received body as a whole first, and tells the models so.
        return refuse_unstorable(data, info)

    def job_key(self) -> str | None:
        """The job this event is about (the CloudEvents `subject`), if any."""
        job_id = getattr(self, "job_id", None)
        if job_id is None and (spec := getattr(self, "spec", None)) is not None:
            job_id = spec.job_id
        return job_id


class ExitReason(StrEnum):
    SUCCEEDED = "Succeeded"
    OOM_KILLED = "OOMKilled"
    ERROR = "Error"
    CANCELLED = "Cancelled"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    NODE_FAILURE = "NodeFailure"
    EVICTED = "Evicted"
    IMAGE_PULL = "ImagePullFailed"
    PODS_NOT_READY = "PodsNotReady"  # the gang was never Ready within the retry limit
    # No executor heartbeat listed the job for the liveness timeout, or it ran past its runtime limit plus grace:
    # declared by the scheduler's liveness watch (services/scheduler/liveness.py), which frees its quota and GPUs.
    LOST = "Lost"


class PreemptionReason(StrEnum):
    """Why a running job was stopped and requeued. The first five are the preemption service's decisions; the
    others are the Kubernetes executor's: the job's node failed (it resumes from its checkpoint), its gang was not
    Ready in time, or a pod could not run where gpuq placed it."""

    PRIORITY = "PriorityPreemption"
    RECLAIM = "ReclaimQuota"
    # The job's queue has stop_policy HoldAndDrain: admission asks the preemption service to evict its preemptible
    # running jobs (PreemptionRequested with this reason and preemptor `drain:<queue>`; docs/admission.md).
    DRAIN = "QueueDrained"
    # Idle reclaim (queues.yaml `job_classes`, docs/admission.md "Interactive work"): telemetry saw the job's GPUs idle
    # past its class's warning and grace, and asks the preemption service (preemptor `idle:<job>`, the job the only
    # candidate) to checkpoint and requeue it. Never a job of a class that is never preempted.
    IDLE = "IdleReclaim"
    # Defragmentation (docs/preemption.md, "Defragmentation"): the scheduler asks the preemption service to move a
    # checkpointing job (preemptor: the gang waiting on scattered GPUs, candidates: the jobs to move); it checkpoints,
    # is requeued and is placed again on the holes the scheduler holds for it.
    DEFRAGMENTATION = "DefragmentationMove"
    NODE_FAILURE = "NodeFailure"
    PODS_READY_TIMEOUT = "PodsReadyTimeout"
    PLACEMENT_FAILED = "PlacementFailed"


# --------------------------------------------------------------------------- job lifecycle


class JobSubmitted(Payload):
    """Published on `<ns>.job.submitted.<team>`: the team is the subject's, which only that team's credential (and
    the trusted producers: API, Kubernetes intake, admins) may publish on."""

    aggregate, fact = "job", "submitted"
    scope = "team"
    spec: JobSpec
    # The producer's clock, informational only: queue order uses the time admission received the job.
    submitted_at: datetime | None = None
    submitted_by: str | None = None  # who the producer says submitted (audited as a claim)


class JobRejected(Payload):
    aggregate, fact = "job", "rejected"
    job_id: str
    team: str | None = None
    queue: str | None = None
    reason: str
    message: str


class JobQueued(Payload):
    aggregate, fact = "job", "queued"
    job_id: str
    queue: str
    team: str
    position: int | None = None


class JobPending(Payload):
    """Why a job waits, where it stands, and when it is expected to start."""

    aggregate, fact = "job", "pending"
    channel = "status"
    job_id: str
    queue: str
    stage: str = "admission"  # admission | placement
    reason: str
    message: str
    position_in_queue: int | None = None
    position_in_cohort: int | None = None
    eta: datetime | None = None  # most likely start
    eta_low: datetime | None = None  # p10 of the start (the range users are shown), when admission gives one
    eta_high: datetime | None = None  # p90


class JobAdmitted(Payload):
    aggregate, fact = "job", "admitted"
    job_id: str
    spec: JobSpec
    flavors: dict[str, str] = Field(default_factory=dict)  # pod set -> GPU model
    quota: dict[str, int] = Field(default_factory=dict)  # resource -> amount reserved
    borrowing: bool = False
    submitted_at: datetime | None = None
    admitted_at: datetime


class JobPlaced(Payload):
    aggregate, fact = "job", "placed"
    job_id: str
    spec: JobSpec
    bindings: tuple[GpuBinding, ...]
    racks_spanned: int = 1
    blocks_spanned: int = 1
    placed_at: datetime
    fencing_token: int | None = None  # the scheduler leader's term that decided it
    resume_from: str | None = None  # checkpoint URI when resuming after preemption


class JobStarted(Payload):
    aggregate, fact = "job", "started"
    job_id: str
    nodes: tuple[str, ...] = ()
    started_at: datetime


class JobCompleted(Payload):
    aggregate, fact = "job", "completed"
    job_id: str
    exit_reason: ExitReason = ExitReason.SUCCEEDED
    finished_at: datetime


class JobFailed(Payload):
    """The job's end: its last attempt failed (no retry policy, a reason not retried, or the backoff limit
    reached: the message then says after how many attempts)."""

    aggregate, fact = "job", "failed"
    job_id: str
    exit_reason: ExitReason = ExitReason.ERROR
    message: str = ""
    finished_at: datetime
    attempts: int | None = Field(default=None, ge=1)  # attempts the job made, when it had a retry policy


class JobAttemptFailed(Payload):
    """One attempt failed and the job's retry policy retries it: not an end. Published by the executor that saw
    the failure (it counts the attempts); every service frees what the attempt held as for an end (GPUs, quota,
    its run), metering charges the attempt, and admission holds the job pending (`BackoffAfterFailure`) until
    `retry_not_before`, then admits it again (JobRequeued), resuming from `checkpoint_uri` if there is one."""

    aggregate, fact = "job", "attempt_failed"
    job_id: str
    attempt: int = Field(ge=1)  # the attempt that failed, 1-based
    attempts_allowed: int = Field(ge=2)  # 1 + the policy's backoff_limit
    exit_reason: ExitReason
    message: str = ""
    finished_at: datetime
    retry_not_before: datetime
    checkpoint_uri: str | None = None
    lost_gpu_seconds: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _retry_left(self) -> JobAttemptFailed:
        if self.attempt >= self.attempts_allowed:
            raise ValueError(f"attempt {self.attempt} of {self.attempts_allowed} is the last: that is a JobFailed")
        if self.retry_not_before < self.finished_at:
            raise ValueError("retry_not_before is before finished_at")
        return self


class JobCancelled(Payload):
    """The authoritative cancel, published by admission only, after it checked the request's team."""

    aggregate, fact = "job", "cancelled"
    job_id: str
    by: str
    reason: str = ""
    cancelled_at: datetime | None = None


class JobCancelRequested(Payload):
    """A user's request, published on `<ns>.job.cancel_requested.<team>`. Admission grants it only for a job of
    that team (a request for a job it does not know yet leaves a tombstone), then publishes JobCancelled."""

    aggregate, fact = "job", "cancel_requested"
    scope = "team"
    job_id: str
    requested_by: str | None = None  # claimed, audited as such
    reason: str = ""
    requested_at: datetime | None = None


class JobApproved(Payload):
    """A platform admin approved a job of a priority class that needs approval (`gpuq approve JOB`). Only the
    admin and API credentials may publish it."""

    aggregate, fact = "job", "approved"
    job_id: str
    approved_by: str
    approved_at: datetime | None = None


class CheckpointRequested(Payload):
    aggregate, fact = "job", "checkpoint_requested"
    job_id: str
    preemption_id: str
    deadline: datetime


class JobCheckpointed(Payload):
    aggregate, fact = "job", "checkpointed"
    job_id: str
    uri: str
    step: int | None = None
    checkpointed_at: datetime
    preemption_id: str | None = None


class JobPreempted(Payload):
    aggregate, fact = "job", "preempted"
    job_id: str
    reason: PreemptionReason
    preemptor: str | None = None
    preemption_id: str | None = None
    lost_gpu_seconds: float = 0.0
    checkpoint_uri: str | None = None
    preempted_at: datetime


class JobRequeued(Payload):
    aggregate, fact = "job", "requeued"
    job_id: str
    spec: JobSpec
    resume_from: str | None = None
    submitted_at: datetime  # the original submit time, kept for ordering


class JobIdleWarned(Payload):
    """Idle reclaim's warning (services/telemetry/idle.py): the job's GPUs have stayed below its class's threshold for
    its `idle_for_s`; it is reclaimed (`action`: requeue or end) at `deadline` unless they are used. The team's
    webhook `job.idle_warned`, and a Warning Event `GpuIdle` on its Kubernetes workload; `message` names the
    threshold, the idle time and the grace."""

    aggregate, fact = "job", "idle_warned"
    job_id: str
    team: str
    user: str | None = None
    idle_since: datetime
    deadline: datetime
    action: str
    message: str = Field(default="")


class JobGrowRequested(Payload):
    """The scheduler found idle GPUs for one more pod of a running elastic job (docs/scheduler.md, "Elastic jobs"):
    it asks admission, the owner of the quota, to charge `pods` pods (the job runs `pods_before`)."""

    aggregate, fact = "job", "grow_requested"
    job_id: str
    pods_before: int
    pods: int


class JobResizeAdmitted(Payload):
    """Admission's word on a running elastic job's size: the queue is charged for at most `pods` pods. Above what is
    placed: a grow granted, charged already (`quota`: the job's whole charge); the scheduler places what still fits.
    Below: give pods back (a job waits for admission); the charge goes when the scheduler says they went
    (JobResized). `granted` False: a grow refused for quota (`pods` is what is charged)."""

    aggregate, fact = "job", "resize_admitted"
    job_id: str
    pods: int
    granted: bool = True
    quota: dict[str, int] = Field(default_factory=dict)
    message: str = Field(default="")


class JobResized(Payload):
    """The scheduler grew or shrank a running elastic job: it runs `pods` pods now (`bindings`, all of them; it ran
    `pods_before`). `reason`: Grow, Shrink; `for_job`: the waiting job a shrink made room for. Admission charges
    exactly `pods` pods; the executor writes the new target into the workload and tells its pods."""

    aggregate, fact = "job", "resized"
    job_id: str
    spec: JobSpec
    bindings: tuple[GpuBinding, ...]
    pods_before: int
    pods: int
    reason: str
    for_job: str | None = None
    fencing_token: int | None = None


# --------------------------------------------------------------------------- preemption


class PreemptionRequested(Payload):
    aggregate, fact = "preemption", "requested"
    preemptor: str
    queue: str
    reason: PreemptionReason
    need: dict[str, int] = Field(default_factory=dict)  # resource -> amount that must be freed
    # resource -> the part of `need` that must come from the preemptor's own queue (admission's within-queue
    # preemption; with reason ReclaimQuota, preempting in the queue and reclaiming in the cohort together)
    own_need: dict[str, int] = Field(default_factory=dict)
    # borrow_within_cohort: the preemptor borrows; victims of other queues must have at most this priority
    max_victim_priority: int | None = None
    candidates: tuple[str, ...] = ()  # suggested victims, best first
    message: str = ""


# --------------------------------------------------------------------------- utilisation and inventory


class GpuSample(BaseModel):
    """One GPU (or one MIG instance of it) over the interval that ends at the batch's `sampled_at`."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    job_id: str | None = None
    gpu_index: int
    utilization_pct: float = Field(ge=0, le=100)
    memory_used_mib: int = Field(default=0, ge=0)
    power_w: float = Field(default=0.0, ge=0)
    temperature_c: float | None = None
    # Optional since v1 was first published (dcgm-exporter through Prometheus fills them; the simulator does not).
    gpu_uuid: str | None = None
    gpu_instance: int | None = Field(default=None, ge=0)  # MIG GPU instance id (DCGM's GPU_I_ID)
    mig_profile: str | None = None  # MIG profile of that instance (GPU_I_PROFILE), e.g. "1g.10gb"
    fb_free_mib: int | None = Field(default=None, ge=0)
    tensor_active_pct: float | None = Field(default=None, ge=0, le=100)  # tensor-pipe activity: the MFU proxy
    # True when the job was inferred from a node-level split (no pod labels, no GPU-level placement known).
    approximate: bool = False


class UtilizationSampled(Payload):
    """One event per node per interval, carrying every GPU of the node (batched for rate)."""

    aggregate, fact = "utilization", "sampled"
    node: str
    gpu_model: str | None = None
    sampled_at: datetime
    interval_s: float = Field(gt=0)
    samples: tuple[GpuSample, ...]
    source: str | None = None  # "sim" (synthetic) or "dcgm" (dcgm-exporter through Prometheus)


class UtilizationSourceChecked(Payload):
    """The outcome of one poll of a utilisation source: telemetry turns it into the source's health metrics.

    `reason` is a machine code when `ok` is false: Unreachable, Timeout, HttpError, QueryError, BadResponse."""

    aggregate, fact = "utilization", "source_checked"
    source: str
    endpoint: str = ""
    ok: bool
    reason: str | None = None
    message: str = ""
    checked_at: datetime
    interval_s: float | None = Field(default=None, gt=0)  # how often the source polls (staleness)
    series: int = Field(default=0, ge=0)  # series read in this poll
    gpus_exact: int = Field(default=0, ge=0)  # GPUs attributed from pod labels or a GPU-level placement
    gpus_approximate: int = Field(default=0, ge=0)  # GPUs attributed by a node-level split
    gpus_unattributed: int = Field(default=0, ge=0)  # GPUs no job holds (or none we know of)
    series_dropped: int = Field(default=0, ge=0)  # series without a usable node/GPU label or value


class JobFlopsReported(Payload):
    """A running job's achieved throughput, summed over all its GPUs, in TFLOP/s of one precision. Telemetry
    divides it by the peak of the job's GPUs (queues.yaml gpu_flavors.*.peak_tflops) to get MFU.

    Published by the job itself (see shared/mfu.py `flops_event`) on `<ns>.utilization.flops_reported.<team>` with
    its team's credential: telemetry believes a report only for a job of the subject's team. On the utilisation
    stream, not the job stream, because jobs may report every few seconds and lifecycle consumers have no use
    for it."""

    aggregate, fact = "utilization", "flops_reported"
    scope = "team"
    job_id: str
    achieved_tflops: float = Field(gt=0, allow_inf_nan=False)
    precision: Precision
    reported_at: datetime
    step: int | None = Field(default=None, ge=0)


INVENTORY_CHUNK = 500  # nodes per NodeInventory part: ~250-450 bytes each, far below NATS's 1 MiB max_payload


class NodeInventory(Payload):
    """Every node of a source, announced in `parts` events of at most INVENTORY_CHUNK nodes each (one NATS message
    holds 1 MiB by default: a 5,000-node cluster does not fit in one). Each part means "these nodes are as given"
    on its own, so consumers upsert a part's nodes as it comes; only "every node not announced is gone" waits for
    the last part of an `announcement` (parts of one announcement travel in order on one subject)."""

    aggregate, fact = "node", "inventory"
    nodes: tuple[NodeSpec, ...]
    source: str = "sim"
    part: int = Field(default=1, ge=1)
    parts: int = Field(default=1, ge=1)
    announcement: str = ""  # shared by the parts of one announcement ("" for a single-part one)

    @model_validator(mode="after")
    def _part_in_range(self) -> NodeInventory:
        if self.part > self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: a part number cannot exceed the number of parts")
        if self.parts > 1 and not self.announcement:
            raise ValueError(f"part {self.part} of {self.parts} names no announcement: the parts could not be "
                             "told apart from another announcement's")
        return self

    @property
    def last_part(self) -> bool:
        return self.part == self.parts

    @classmethod
    def chunked(cls, nodes: tuple[NodeSpec, ...] | list[NodeSpec], *, source: str, announcement: str,
                chunk: int = INVENTORY_CHUNK) -> list[NodeInventory]:
        """The announcement of `nodes` (sorted by name) as parts of at most `chunk` nodes; one part when they fit,
        and one empty part for no nodes at all."""
        ordered = sorted(nodes, key=lambda n: n.name)
        slices = [tuple(ordered[i:i + chunk]) for i in range(0, len(ordered), chunk)] or [()]
        if len(slices) == 1:
            return [cls(nodes=slices[0], source=source)]
        return [cls(nodes=part_nodes, source=source, part=i + 1, parts=len(slices), announcement=announcement)
                for i, part_nodes in enumerate(slices)]


class NodeChanged(Payload):
    aggregate, fact = "node", "changed"
    node: NodeSpec
    change: str = "updated"  # added | updated | removed
    # Why the node's health changed (a machine code such as "Xid79" or "GpuMissing"), and a sentence for people.
    reason: str | None = None
    message: str = ""


class ExecutorHeartbeat(Payload):
    """An executor is alive and runs these jobs (placed ones not started yet included): one event per executor per
    interval, listing its jobs, not one per job, so that liveness costs the bus a constant rate whatever the
    number of jobs. A long list is split into parts (`part` of `parts`), each a heartbeat for the jobs it lists."""

    # On the UTILIZATION stream (2 days, size-capped) with the other high-rate executor reports: a heartbeat is
    # needed only until the scheduler has read it, not for the CLUSTER stream's 30 days.
    aggregate, fact = "utilization", "heartbeat"
    executor: str  # the executor's name (its events' source)
    running: tuple[str, ...] = ()
    sent_at: datetime
    interval_s: float = Field(gt=0)
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1)


class QueueConfigChanged(Payload):
    """A queues.yaml document. Without `config_version`: a proposed change (`gpuq apply-queues`, the API), which
    admission, the configuration's one owner, validates and records as the next version unless its content is the
    version in force. With `config_version` and `config_hash`: admission's publication of a version it recorded; the
    other services then take the version in force from admission's read model (`admission.v1_config`), never from
    the event's content (docs/admission.md, "The configuration in force")."""

    aggregate, fact = "queue", "config_changed"
    config: dict[str, Any]  # a queues.yaml document, validated by admission before use
    changed_by: str = "admin"
    config_version: int | None = Field(default=None, ge=1)  # set by admission only: the version it recorded
    config_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")  # sha256 of the document (queues_hash)
    # A proposal made with `gpuq apply-queues --force` (or the API's `force: true`): admission applies it although it
    # raises a guarantee past the cluster's capacity, names a GPU model the cluster lacks or removes a queue that
    # holds jobs, and audits that it was forced. Added since v1: written only when set.
    force: bool | None = Field(default=None, exclude_if=unset)


class QueueUsageReported(Payload):
    """The metering service's read model of each queue's past GPU use, for fair share over time (queues.yaml
    `policy.usage_half_life_s`): per queue and GPU model, the GPU-seconds its jobs held, each counted 2^(−a/H) for
    a GPU-second held `a` seconds before `at` (H = `half_life_s`), from the ledger's allocations. Published by
    metering every few minutes of platform time; the admission service orders queues with it."""

    aggregate, fact = "queue", "usage_reported"
    at: datetime
    half_life_s: float = Field(gt=0)
    usage: dict[str, dict[str, float]] = Field(default_factory=dict)  # queue -> GPU model -> decayed GPU-seconds

    @field_validator("usage")
    @classmethod
    def _non_negative(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        bad = sorted(f"{q}/{m}" for q, per in v.items() for m, x in per.items() if not 0 <= x < float("inf"))
        if bad:
            raise ValueError(f"decayed usage must be finite and >= 0; check {', '.join(bad)}")
        return v


# --------------------------------------------------------------------------- audit


class AuditRecorded(Payload):
    """One audit record, published by the service that did or refused the action on `<ns>.audit.recorded.<service>`
    (the subject names the recorder: only that service's credential may publish there). The audit service stores
    them append-only; a SIEM may subscribe to `<ns>.audit.>`."""

    aggregate, fact = "audit", "recorded"
    scope = "service"
    action: str  # submit, reject, cancel, cancel_refused, admit, place, preempt, approve, config_applied, ...
    actor: str  # the authenticated identity: team:<team> (its bus credential), token:<name>, admin:<name>, service
    at: datetime
    job_id: str | None = None
    team: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)


CATALOGUE: tuple[type[Payload], ...] = (
    JobSubmitted, JobRejected, JobQueued, JobPending, JobAdmitted, JobPlaced, JobStarted, JobCompleted,
    JobFailed, JobAttemptFailed, JobCancelled, JobCancelRequested, JobApproved, CheckpointRequested, JobCheckpointed,
    JobPreempted, JobRequeued, PreemptionRequested, UtilizationSampled, NodeInventory, NodeChanged, QueueConfigChanged,
    AuditRecorded, UtilizationSourceChecked, JobFlopsReported, ExecutorHeartbeat, QueueUsageReported, JobIdleWarned,
    JobGrowRequested, JobResizeAdmitted, JobResized,
)
BY_TYPE: dict[str, type[Payload]] = {cls.event_type(): cls for cls in CATALOGUE}


# --------------------------------------------------------------------------- envelope

# Where an event's `dataschema` points: the committed JSON Schema of its type, `shared/schemas/<type>.json`, whose
# `$id` is this URI. The type carries the major version (`...v1`), so the URI changes exactly when the contract does
# (a v2 is a new type); additive v1 changes keep it. The URI is an identifier, resolved from the committed files
# (`shared.schemas.schema_for_uri`), not fetched.
SCHEMA_URI_BASE = "https://gpuq.io/schemas/"
JSON_CONTENT_TYPE = "application/json"
# CloudEvents 1.0 section 3.1.1: attribute names are lower-case ASCII letters and digits only.
ATTRIBUTE_NAME = re.compile(r"^[a-z0-9]+$")
# RFC 3339 `date-time` (CloudEvents' Timestamp): a full date, `T`, a full time and a zone offset. Python and pydantic
# accept much more (a space for the `T`, no seconds, no offset, unix numbers): those are refused.
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
# URI-reference (RFC 3986, `source`): only the characters a URI may hold, at least one.
URI_REFERENCE = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$")
# Absolute URI (RFC 3986, `dataschema`): a scheme, then at least one URI character.
ABSOLUTE_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$")
# A JSON media type: `data` is always a JSON object here (the cloudevents SDK's JSON format uses the same test).
JSON_MEDIA_TYPE = re.compile(r"^(application|text)/([a-zA-Z0-9\-.]+\+)?json(;.*)?$")


_ATTRIBUTE_RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "source": (URI_REFERENCE, "a URI-reference (RFC 3986)"),
    "datacontenttype": (JSON_MEDIA_TYPE, "a JSON media type (data is a JSON object)"),
    "dataschema": (ABSOLUTE_URI, "an absolute URI (RFC 3986)"),
}
# (attribute, value) pairs that passed their rule above: a pair in here passes again without the regular expression.
_GOOD_ATTRIBUTE_VALUES: set[tuple[str | None, Any]] = set()
_GOOD_ATTRIBUTE_VALUES_MAX = 4096


def schema_uri(event_type: str) -> str:
    """The `dataschema` of an event type: the URI (and `$id`) of its committed JSON Schema."""
    return f"{SCHEMA_URI_BASE}{event_type}.json"


class CloudEvent(BaseModel):
    """CloudEvents 1.0 structured-mode envelope (JSON event format). `traceparent` is the W3C trace context
    (CloudEvents distributed tracing extension). Holds what the spec requires and forbids: non-empty `id`,
    `source`, `type`, `specversion`; `time` an RFC 3339 timestamp with a zone; optional attributes non-empty when
    present; extension attributes named with lower-case letters and digits, valued with strings, integers or
    booleans. gpuq also requires `time` and a JSON object `data`."""

    model_config = ConfigDict(extra="allow", frozen=True,
                              json_schema_extra={"propertyNames": {"pattern": ATTRIBUTE_NAME.pattern}})
    specversion: str = Field(min_length=1, json_schema_extra={"const": SPEC_VERSION})
    id: str = Field(min_length=1)
    source: str = Field(min_length=1, pattern=URI_REFERENCE.pattern)
    type: str = Field(min_length=1)
    time: datetime
    subject: str | None = Field(default=None, min_length=1)
    datacontenttype: str = Field(default=JSON_CONTENT_TYPE, pattern=JSON_MEDIA_TYPE.pattern)
    dataschema: str | None = Field(default=None, min_length=1, pattern=ABSOLUTE_URI.pattern)
    traceparent: str | None = None
    data: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, doc: Any) -> Any:
        # JSON event format: an attribute whose value is null is treated as absent. (`in` first: almost no event
        # has a null attribute, and the copy would cost every one of them.)
        if isinstance(doc, dict) and None in doc.values():
            return {k: v for k, v in doc.items() if v is not None}
        return doc

    @field_validator("time", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        if isinstance(value, datetime):
            if value.tzinfo is None or value.utcoffset() is None:
                raise ValueError("time must be timezone-aware (RFC 3339 requires a zone offset)")
            return value
        if not isinstance(value, str) or not RFC3339.match(value):
            raise ValueError(f"time must be an RFC 3339 timestamp with a zone offset, like "
                             f"2026-11-30T12:00:00Z; got {value!r}")
        return value

    @field_validator("source", "datacontenttype", "dataschema", mode="before")
    @classmethod
    def _uri_and_media_type(cls, value: Any, info: ValidationInfo) -> Any:
        # A few values recur in every event (the services' sources, one schema per type): each is checked once.
        if not isinstance(value, str):  # a list or an object (unhashable) is refused by the field's type
            return value
        if (info.field_name, value) in _GOOD_ATTRIBUTE_VALUES:
            return value
        rule, what = _ATTRIBUTE_RULES[info.field_name or ""]
        if value:
            if not rule.match(value):
                raise ValueError(f"{info.field_name} must be {what}; got {value!r}")
            if len(_GOOD_ATTRIBUTE_VALUES) >= _GOOD_ATTRIBUTE_VALUES_MAX:  # bounded: sources come from publishers
                _GOOD_ATTRIBUTE_VALUES.clear()
            _GOOD_ATTRIBUTE_VALUES.add((info.field_name, value))
        return value

    @model_validator(mode="after")
    def _extensions(self) -> CloudEvent:
        for name, value in sorted((self.model_extra or {}).items()):
            if name == "data_base64":
                raise ValueError("data_base64: binary data is not accepted; data must be a JSON object")
            if not ATTRIBUTE_NAME.match(name):
                raise ValueError(f"extension attribute {name!r}: names must be lower-case letters and digits only")
            # JSON format type mapping: String -> string, Integer -> integral number, Boolean -> boolean.
            if isinstance(value, float) or not isinstance(value, str | int | bool):
                raise ValueError(f"extension attribute {name!r}: the value must be a string, an integer or a "
                                 f"boolean, not {type(value).__name__}")
            if value == "":
                raise ValueError(f"extension attribute {name!r}: a string value must not be empty")
        return self

    def payload(self) -> Payload:
        """The typed payload (validated on `parse_event`; this re-validates cheaply)."""
        return BY_TYPE[self.type].model_validate(self.data)


class InvalidEvent(ValueError):
    """Raised for bytes that are not a valid gpuq event; `reason` is a short machine code."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


def new_event_id() -> str:
    """A random (version 4) UUID, as `str(uuid.uuid4())` gives, formatted from the random bytes directly: the
    `uuid.UUID` object costs more than the randomness, and every emitted event takes an id."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40  # version 4
    b[8] = (b[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# One validated envelope per (type, source): an event built here differs from it only in what `make_event` has
# checked itself or made (id, an aware time, subject, traceparent, the payload's own dump), so a copy with those
# replaced is the envelope validation would build, without validating attributes that never change.
_TEMPLATES: dict[tuple[str, str], CloudEvent] = {}
_TEMPLATES_MAX = 1024


def make_event(payload: Payload, *, source: str, time: datetime, subject: str | None = None,
               event_id: str | None = None, traceparent: str | None = None) -> CloudEvent:
    """The envelope of `payload`. Publishers build their events with `shared.tracing.traced_event`, which calls
    this with a trace context; `time` must carry a zone (a naive time is an error, not a guess)."""
    if time.tzinfo is None or time.utcoffset() is None:
        raise ValueError(f"make_event: time {time.isoformat()} has no zone; pass a timezone-aware datetime "
                         "(e.g. datetime.now(UTC) or shared.events.utcnow_from(clock.now()))")
    event_type = payload.event_type()
    subject = subject if subject is not None else payload.job_key()
    if subject == "" or traceparent == "" or not isinstance(traceparent, str | None):
        # Not the common shape: validation gives its precise error (an empty subject is refused).
        return CloudEvent(specversion=SPEC_VERSION, id=event_id or new_event_id(), source=source, type=event_type,
                          time=time, subject=subject, dataschema=schema_uri(event_type), traceparent=traceparent,
                          data=payload.model_dump(mode="json"))
    template = _TEMPLATES.get((event_type, source))
    if template is None:
        # Validated once: a source that is no URI-reference is refused here as it always was.
        template = CloudEvent(specversion=SPEC_VERSION, id="template", source=source, type=event_type, time=time,
                              dataschema=schema_uri(event_type), data={})
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        _TEMPLATES[(event_type, source)] = template
    # Absent attributes stay unset, as validation drops a null one (`_null_is_absent`).
    update: dict[str, Any] = {"id": event_id or new_event_id(), "time": time, "data": payload.model_dump(mode="json")}
    if subject is not None:
        update["subject"] = subject
    if traceparent is not None:
        update["traceparent"] = traceparent
    return template.model_copy(update=update)


def encode_event(event: CloudEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode()


# The envelope attributes of one (type, source) around an event's own (id, time, subject, traceparent, data), as
# `encode_event` writes them: `"source"` and `"type"` after the id, `"datacontenttype"` and `"dataschema"` after the
# time (the model's field order; absent attributes are left out as `exclude_none` leaves them out).
_FRAMES: dict[tuple[str, str], tuple[bytes, bytes]] = {}
_TIME_JSON = TypeAdapter(datetime)
_OPEN = b'{"specversion":' + to_json(SPEC_VERSION) + b',"id":"'
_last_time: list[Any] = [None, b""]  # the last time encoded and its JSON: a unit of work's events share their time


@dataclass(frozen=True, slots=True)
class EmittedEvent:
    """An event as a publisher wrote it to its outbox: its id and body (what the relay publishes), and the payload it
    was built from. `event()` is the envelope a consumer receives (the body parsed)."""

    id: str
    body: bytes
    payload: Payload

    @property
    def type(self) -> str:
        return self.payload.event_type()

    def event(self) -> CloudEvent:
        return parse_event(self.body)[0]


def encode_new_event(payload: Payload, *, source: str, time: datetime, traceparent: str,
                     subject: str | None = None) -> tuple[str, bytes]:
    """(id, body) of a new event: the bytes `encode_event(make_event(...))` gives for it, written without building
    the envelope object and serialising it again (the path of every event a service emits: about a third of what
    `make_event` and `encode_event` cost together). The (type, source) attributes are validated once, by the same
    template `make_event` validates; `traceparent` must be one `outgoing_traceparent` returned. An uncommon shape
    (an empty subject) takes `make_event`, which refuses it with validation's precise error."""
    if time.tzinfo is None or time.utcoffset() is None:
        make_event(payload, source=source, time=time, subject=subject, traceparent=traceparent)  # raises
    subject = subject if subject is not None else payload.job_key()
    if subject == "" or not traceparent:
        event = make_event(payload, source=source, time=time, subject=subject, traceparent=traceparent)
        return event.id, encode_event(event)
    event_type = payload.event_type()
    frame = _FRAMES.get((event_type, source))
    if frame is None:
        template = _TEMPLATES.get((event_type, source))
        if template is None:  # make_event validates source and type, and keeps the template it validated
            make_event(payload, source=source, time=time, subject=subject, traceparent=traceparent)
            template = _TEMPLATES[(event_type, source)]
        frame = (b',"source":' + to_json(template.source) + b',"type":' + to_json(template.type),
                 b',"datacontenttype":' + to_json(template.datacontenttype)
                 + (b',"dataschema":' + to_json(template.dataschema) if template.dataschema is not None else b""))
        if len(_FRAMES) >= _TEMPLATES_MAX:
            _FRAMES.clear()
        _FRAMES[(event_type, source)] = frame
    if _last_time[0] is not time:
        _last_time[0], _last_time[1] = time, _TIME_JSON.dump_json(time)
    event_id = new_event_id()
    body = b"".join((
        _OPEN, event_id.encode(), b'"', frame[0], b',"time":', _last_time[1],
        b',"subject":' + to_json(subject) if subject is not None else b"", frame[1],
        b',"traceparent":', to_json(traceparent), b',"data":', payload.__pydantic_serializer__.to_json(payload),
        b"}"))
    return event_id, body


# Limits on a received body (docs/events.md, "Limits"), checked before it is parsed, so that no body can make the
# parser or a validator exhaust the stack or the memory of a consumer: its size, and how deeply its arrays and
# objects nest (gpuq's deepest events, a pod template's Kubernetes volumes, nest about 15 deep; Python's JSON parser
# gives up with RecursionError near 1,000). The envelope's `id` and `subject` are primary keys of every service's
# inbox and job traces: an index entry holds about 2.7 KB.
MAX_EVENT_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_ID_CHARS = 256
# A JSON string, to the end of the text when it is not closed (possessive, and always matching once begun: linear
# time whatever the body, where a backtracking pattern would be quadratic on a hostile one).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]
# What may hide a string Postgres cannot store in a JSON text: the escape of NUL, the escape of a surrogate (a pair is
# fine, a lone one is not), or the UTF-8 bytes of a surrogate (Python's JSON parser takes them); and a body larger
# than one string may be. Only a body with one of these is searched string by string.
_SUSPECT = re.compile(rb"\\u0000|\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Do the arrays and objects of the JSON text `raw` nest deeper than `limit`? Read without parsing: brackets
    inside strings do not count. Nearly every body has fewer brackets than the limit, and is answered by counting."""
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return False
    structure = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return any(depth > limit for depth in accumulate(_DEPTH_STEP[b] for b in structure))


def _doc_too_deep(doc: Any, limit: int = MAX_DEPTH) -> bool:
    """`too_deep` for an already parsed document (an in-process dict): iterative."""
    stack: list[tuple[int, Any]] = [(1, doc)]
    while stack:
        depth, item = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > limit:
                return True
            stack.extend((depth + 1, sub) for sub in (item.values() if isinstance(item, dict) else item))
    return False


def parse_event(raw: bytes | str | dict[str, Any]) -> tuple[CloudEvent, Payload]:
    """Decode and validate an event. Raises InvalidEvent with a precise reason; never anything else (whatever a
    body holds, a consumer dead-letters it and goes on)."""
    try:
        return _parse_event(raw)
    except InvalidEvent:
        raise
    except RecursionError:
        raise InvalidEvent("TooDeep", f"the body nests too deeply to be read (limit {MAX_DEPTH})") from None
    except Exception as exc:  # a guarantee: any other failure to read a body is a verdict on it
        raise InvalidEvent("Unreadable", f"{type(exc).__name__}: {exc}") from None


def _parse_event(raw: bytes | str | dict[str, Any]) -> tuple[CloudEvent, Payload]:
    if isinstance(raw, dict):
        if _doc_too_deep(raw):
            raise InvalidEvent("TooDeep", f"the event nests deeper than {MAX_DEPTH} levels of arrays and objects")
        doc: Any = raw
        suspect = True
    else:
        body = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        if len(body) > MAX_EVENT_BYTES:
            raise InvalidEvent("TooLarge", f"the body is {len(body)} bytes, above the limit of {MAX_EVENT_BYTES}")
        if too_deep(body):
            raise InvalidEvent("TooDeep", f"the body nests deeper than {MAX_DEPTH} levels of arrays and objects")
        try:
            doc = _decode_json(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidEvent("MalformedJson", f"body is not JSON: {exc}") from None
        # (a backslash is rare in a body gpuq wrote, and single bytes are found fastest)
        suspect = len(body) > MAX_STRING_CHARS or (((b"\\" in body and b"\\u" in body) or b"\xed" in body)
                                                   and _SUSPECT.search(body) is not None)
    if not isinstance(doc, dict):
        raise InvalidEvent("MalformedEnvelope", "body is not a JSON object")
    if suspect and (problem := unstorable(doc)) is not None:
        # Refused before validation, naming where: a handler would fail on it in Postgres, every time.
        raise InvalidEvent("InvalidPayload" if problem.startswith("data") else "MalformedEnvelope", problem)
    if doc.get("specversion") not in (None, SPEC_VERSION):
        raise InvalidEvent("UnsupportedSpecVersion", f"specversion {_shown_value(doc['specversion'])}, expected 1.0")
    try:
        envelope = CloudEvent.model_validate(doc)
    except ValidationError as exc:
        raise InvalidEvent("MalformedEnvelope", _first_errors(exc)) from None
    for name in ("id", "subject"):
        value = getattr(envelope, name)
        if value is not None and len(value) > MAX_ID_CHARS:
            raise InvalidEvent("MalformedEnvelope", f"{name}: {len(value)} characters, above the limit of "
                                                    f"{MAX_ID_CHARS}")
    cls = BY_TYPE.get(envelope.type)
    if cls is None:
        raise InvalidEvent("UnknownEventType", f"unknown event type {_shown_value(envelope.type)}")
    if envelope.dataschema is not None and envelope.dataschema.startswith(SCHEMA_URI_BASE) \
            and envelope.dataschema != schema_uri(envelope.type):
        raise InvalidEvent("MalformedEnvelope", f"dataschema {_shown_value(envelope.dataschema)} is not the schema "
                                                f"of {envelope.type} ({schema_uri(envelope.type)})")
    try:
        # Every string of the body was checked above: the models need not search them again.
        payload = cls.model_validate(envelope.data, context={STRINGS_CHECKED: True})
    except ValidationError as exc:
        raise InvalidEvent("InvalidPayload", f"{envelope.type}: {_first_errors(exc)}") from None
    except (TypeError, ArithmeticError, LookupError, AttributeError) as exc:
        # A validator that met a shape it did not expect (an aware time against a naive one, say): the body's fault.
        raise InvalidEvent("InvalidPayload", f"{envelope.type}: {type(exc).__name__}: {exc}") from None
    return envelope, payload


def _shown_value(value: Any, limit: int = 80) -> str:
    """A received value as an error message quotes it: escaped (the message is stored in Postgres) and cut short."""
    return shown(repr(value), limit)


def _decode_json(raw: bytes | str) -> Any:
    """`json.loads(raw)`, by pydantic-core's parser (about half the CPU) where that one takes the body. It refuses
    some bodies `json.loads` takes (a UTF-16 or BOM-prefixed body, a lone surrogate escape); of the bodies the tests
    try, it takes none that `json.loads` refuses and gives the same values for those both take. `json.loads` decides
    whatever it refuses, so what is JSON, and the error a malformed body is dead-lettered with, are as before."""
    try:
        return from_json(raw)
    except ValueError:
        return json.loads(raw)


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "envelope"
        parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def utcnow_from(ts: float) -> datetime:
    """Datetime for a clock reading in seconds since the epoch (clocks are injected, see shared.clock)."""
    return datetime.fromtimestamp(ts, tz=UTC)
