"""What the telemetry core remembers between events: one record per live job, per node and per node's
latest utilisation sample. Records are plain pydantic models so the shell can persist each one as a JSON
document (`telemetry.jobs`, `telemetry.samples`) and rebuild the core after a restart (nodes are rebuilt from
the scheduler's read model, their one owner).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from shared.domain import JobSpec, NodeSpec, Precision
from shared.events import GpuSample

UNKNOWN = "unknown"
DEFAULT_POOL = "default"


class JobPhase(StrEnum):
    PENDING = "pending"  # waiting for admission (quota) or, once admitted, for placement
    PLACED = "placed"  # GPUs bound, pods starting
    RUNNING = "running"


class FlopsRecord(BaseModel):
    """A running job's latest achieved throughput (JobFlopsReported): TFLOP/s over all its GPUs."""

    model_config = ConfigDict(extra="ignore")
    tflops: float
    precision: Precision
    reported_at: float


class JobRecord(BaseModel):
    """One job the cluster has not finished with. Times are epoch seconds."""

    model_config = ConfigDict(extra="ignore")
    job_id: str
    queue: str = UNKNOWN
    team: str = UNKNOWN
    priority_class: str = UNKNOWN
    feature: str = ""
    spec: JobSpec | None = None
    # Started from a producer's submission (its publisher's team, its spec) that admission has not decided on yet;
    # any fact about the job (JobQueued, JobPending, JobAdmitted ...) makes it admission's job, a refusal of that
    # submission ends it (TelemetryState.submitted).
    claimed: bool = False
    phase: JobPhase = JobPhase.PENDING
    stage: str = "admission"  # admission | placement, while pending
    reason: str = "Queued"
    position: int | None = None
    eta: float | None = None
    # The first ETA the job was given: (given at, most likely start, p10, p90); checked against its start.
    first_eta: tuple[float, float, float, float] | None = None
    submitted_at: float | None = None  # first submission: start of the job completion time
    queued_at: float | None = None  # start of the current wait (resets on requeue): admission wait
    admitted_at: float | None = None
    started_at: float | None = None
    last_checkpoint_at: float | None = None
    # Whole GPUs held, as (node, gpu index); a MIG slice holds its parent GPU index here too.
    gpus: list[tuple[str, int]] = Field(default_factory=list)
    # Share of GPUs held per node in milli-GPUs (a MIG slice is its fraction of a GPU): the peak for MFU.
    shares: list[tuple[str, int]] = Field(default_factory=list)
    flops: FlopsRecord | None = None

    @property
    def holds_gpus(self) -> bool:
        return self.phase in (JobPhase.PLACED, JobPhase.RUNNING)

    def labels(self) -> dict[str, str]:
        return {"queue": self.queue, "team": self.team}


class NodeRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")
    node: NodeSpec
    reason: str | None = None  # why its health last changed (NodeChanged.reason), e.g. "Xid79"
    message: str = ""

    @property
    def pool(self) -> str:
        return self.node.labels.get("pool", DEFAULT_POOL)


class NodeSample(BaseModel):
    """The latest `UtilizationSampled` of one node."""

    model_config = ConfigDict(extra="ignore")
    node: str
    gpu_model: str | None = None
    sampled_at: float
    interval_s: float
    samples: tuple[GpuSample, ...]


class SourceRecord(BaseModel):
    """The latest poll of a utilisation source (UtilizationSourceChecked). Times are epoch seconds."""

    model_config = ConfigDict(extra="ignore")
    source: str
    endpoint: str = ""
    ok: bool
    reason: str | None = None
    checked_at: float
    interval_s: float | None = None
    last_ok_at: float | None = None
    gpus_exact: int = 0
    gpus_approximate: int = 0
    gpus_unattributed: int = 0
