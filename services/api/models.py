"""The API's request and response bodies, as pydantic models: what /openapi.json documents, /docs and /redoc show,
and what FastAPI checks each answer against.

Answers that carry a read model's rows (jobs, reports, FOCUS rows) allow extra keys: a column added to the read model
reaches callers without a change here, and the fields named below are the ones clients may rely on.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.core.metering.focus import FOCUS_COLUMNS
from shared.domain import JobSpec


class _Open(BaseModel):
    """A row that may carry more than the fields named (see the module's docstring)."""

    model_config = ConfigDict(extra="allow")


# --- requests ---------------------------------------------------------------------------------------------------


class Submission(BaseModel):
    jobs: list[JobSpec] = Field(min_length=1, max_length=1000)


class CancelBody(BaseModel):
    reason: str = ""


class WebhookBody(BaseModel):
    url: str
    events: list[str] = Field(default_factory=lambda: ["job.completed", "job.failed", "job.preempted"])
    team: str | None = None  # admins only: another team's, or null for every team


class ConfigBody(BaseModel):
    config: dict[str, Any] = Field(description="The queues configuration, as queues.yaml holds it")
    force: bool = Field(False, description="Apply it although admission would refuse it (a guarantee past the "
                                           "cluster's capacity, an unknown GPU model, a queue removed under its "
                                           "jobs: POST /v1/queues/config/check lists them); audited")


# Filled in by the API when a submission leaves them out: the token's team, the team's default queue, a fresh id.
OPTIONAL_IN_REQUESTS = ("job_id", "team", "queue")


def job_request_schemas(ref_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """POST /v1/jobs's body as OpenAPI shows it, and the component schemas it refers to. The body is parsed by hand
    (its depth is checked before any JSON parser sees it: services/api/app.py `_json_body`), so FastAPI cannot derive
    this from a parameter: it is JobSpec's schema with the fields the API fills in made optional, as one spec, a list
    of them, or {jobs: [...]}."""
    spec = JobSpec.model_json_schema(ref_template=ref_template)
    components: dict[str, Any] = spec.pop("$defs", {})
    spec["title"] = "JobRequest"
    spec["required"] = [f for f in spec.get("required", []) if f not in OPTIONAL_IN_REQUESTS]
    spec["description"] = (
        "A job spec. `team` defaults to the token's team (a team's token may name no other); `queue` to the team's "
        "default queue (the first queue of the team's first namespace in the queue configuration, else the team's "
        "only queue); `job_id` to a fresh id qualified with the team.")
    components["JobRequest"] = spec
    ref = {"$ref": ref_template.format(model="JobRequest")}
    body = {"title": "JobSubmission", "anyOf": [
        ref,
        {"type": "array", "items": ref, "minItems": 1, "maxItems": 1000},
        {"type": "object", "properties": {"jobs": {"type": "array", "items": ref, "minItems": 1, "maxItems": 1000}},
         "required": ["jobs"]},
    ]}
    return body, components


# --- responses --------------------------------------------------------------------------------------------------


class SubmitResult(BaseModel):
    job_id: str
    event_id: str
    verdict: str = Field(description="queued | rejected | cancelled | awaiting_approval | accepted (no verdict yet)")
    reason: str | None = None
    message: str | None = None


class JobStatus(_Open):
    """One job as `gpuq status` shows it. Times are epoch seconds."""

    job_id: str
    team: str
    queue: str
    state: str = Field(description="pending | admitted | placed | running | completed | failed | cancelled | "
                                   "rejected")
    reason: str | None = None
    message: str | None = None
    position_in_queue: int | None = None
    position_in_cohort: int | None = None
    eta: float | None = None
    eta_low: float | None = None
    eta_high: float | None = None
    submitted_at: float | None = None
    admitted_at: float | None = None
    placed_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    nodes: list[str] = Field(default_factory=list)
    sched_reason: str | None = None
    sched_message: str | None = None
    planned_start: float | None = None
    started_at: float | None = None
    gpus: int | None = None
    wait_s: float | None = Field(default=None, description="Seconds waited so far; once running, its wait to start")
    eta_overdue: bool = Field(default=False, description="The expected start passed while the job still waits: `eta` "
                                                         "shows now until the next refresh")
    eta_expected: float | None = Field(default=None, description="With eta_overdue: the start that was expected")


class Explanation(BaseModel):
    job_id: str
    state: str
    lines: list[str] = Field(description="Why it waits, where it stands, when it should start, in words")


class JobRequestSent(BaseModel):
    """A cancel or an approval put on the bus (its effect shows in the job's status)."""

    job_id: str
    event_id: str
    status: str


class QueueRow(_Open):
    """One row of `gpuq queues`; per-resource figures are keyed by GPU model (or resource)."""

    queue: str
    cohort: str | None = None
    weight: float
    strategy: str
    nominal: dict[str, int]
    used: dict[str, int]
    borrowed: dict[str, int]
    lent: dict[str, int]
    pending: int
    inadmissible: int
    running: int
    max_running_jobs: int | None = None
    oldest_wait_s: float | None = None


class HeldNode(BaseModel):
    node: str
    gpu_model: str
    gpus: int
    mig_slices: int
    pods: int


class HeldOutside(BaseModel):
    gpus: int
    mig_slices: int
    line: str | None = Field(description="What `gpuq queues` prints under its table; null when nothing is held")
    nodes: list[HeldNode]


class ConfigProposed(BaseModel):
    event_id: str
    hash: str
    warnings: list[str]


class ConfigInForce(BaseModel):
    version: int
    hash: str
    applied_at: float = Field(description="Epoch seconds, admission's clock")
    applied_by: str | None = None
    source: str
    config: dict[str, Any] | None = Field(default=None, description="The configuration itself (admins only)")


class Report(_Open):
    since: str
    until: str
    by: list[str]
    granularity: str
    rates: dict[str, float] = Field(description="Cost per GPU-hour by GPU model")
    rows: list[dict[str, Any]]
    total: dict[str, Any]


def _focus_columns(schema: dict[str, Any]) -> None:
    schema["properties"] = {c: {"title": c} for c in FOCUS_COLUMNS}


class FocusRow(BaseModel):
    """One FinOps FOCUS 1.0 row (every column of FOCUS 1.0, then gpuq's x_ columns), as `gpuq report --export
    focus` writes it."""

    # The columns are the metering core's (FOCUS_COLUMNS): listed in the schema, passed through as they are.
    model_config = ConfigDict(extra="allow", json_schema_extra=_focus_columns)


class Webhook(BaseModel):
    id: str
    url: str
    team: str | None
    events: list[str]
    active: bool
    created_at: str


class WebhookCreated(BaseModel):
    id: str
    url: str
    team: str | None
    events: list[str]
    secret: str = Field(description="The signing secret, shown once")


class WebhookChanged(BaseModel):
    id: str
    status: str


class WebhookRotated(BaseModel):
    id: str
    secret: str
    previous_secret_valid_until: str | None


class AuditRecord(_Open):
    id: int
    recorder: str
    at: str
    action: str
    actor: str
    team: str | None = None
    job_id: str | None = None
    detail: dict[str, Any] | None = None
