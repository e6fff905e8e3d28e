"""queues.yaml settings for interactive work, per-user limits and GPU-hour budgets (issue 48, items 1, 5 and 6).

- `job_classes`: per job kind (`training`, `inference`, `notebook`), a per-user concurrency cap, a TTL and idle
  reclaim from measured GPU use. `notebook` has defaults even when the section is absent (NOTEBOOK_DEFAULT); the
  other kinds have none unless configured.
- `governance.*.per_user`: limits on one user inside a team (concurrent jobs, GPUs, notebooks).
- `budgets`: GPU-hours per team and period (month or quarter), warned at `warn_at`, enforced at 100% by policy.

Every field here was added since v1: it is written in the stored document only when set (shared/domain.py, `unset`),
so the previous release still reads a configuration that uses none of it. Docs: docs/admission.md ("Interactive
work", "Per-user limits", "GPU-hour budgets").
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class IdleAction(StrEnum):
    """What happens to a job idle past its grace: `requeue` suspends it (checkpointed first when it can be) and puts
    it back in its queue; `end` stops it for good (outcome Idle), also after a checkpoint when it can take one."""

    REQUEUE = "requeue"
    END = "end"


class IdleReclaim(_Strict):
    """Reclaim of a job whose GPUs stay below `threshold_pct` utilisation (DCGM, every GPU of the job) for
    `idle_for_s`: its owner is warned (webhook `job.idle`, Kubernetes Event), and after `grace_s` more of idleness the
    job is reclaimed by `action`. Any sample at or above the threshold restarts the clock; a job with no recent
    sample is never called idle (no data is not idleness)."""

    threshold_pct: float = Field(default=5.0, gt=0, le=100)
    idle_for_s: int = Field(default=1800, ge=60)
    grace_s: int = Field(default=900, ge=0)
    action: IdleAction = IdleAction.REQUEUE


class JobClassPolicy(_Strict):
    """Settings of one job kind: `max_per_user` jobs of this kind per user at once (waiting or running; one more is
    refused at submit, reason TooManyForUser); `ttl_s`: a job of this kind runs at most this long (it is ended, outcome
    TtlExpired, checkpointed first when it can be); `idle`: idle reclaim, null = off."""

    max_per_user: int | None = Field(default=None, ge=1)
    ttl_s: int | None = Field(default=None, ge=60)
    idle: IdleReclaim | None = None


# A notebook class with no configuration of its own: 4 per user, 12 hours, reclaimed (requeued) after 30 idle minutes
# and a 15-minute warning. Notebooks were a label only before; nothing else changes by default.
NOTEBOOK_DEFAULT = JobClassPolicy(max_per_user=4, ttl_s=12 * 3600, idle=IdleReclaim())
NO_CLASS_POLICY = JobClassPolicy()


class UserLimits(_Strict):
    """Limits on one user inside a team (`governance.default.per_user` or `governance.teams.<team>.per_user`). The user
    is the one the authenticated producer stamped on the job (the API: the token's name; Kubernetes: the admission
    review's user), never a name the submitter wrote. null = no limit. A job over a limit is refused at submit, reason
    UserLimit, naming the limit."""

    max_jobs: int | None = Field(default=None, ge=1)  # waiting or running at once
    max_gpus: int | None = Field(default=None, ge=1)  # GPUs of those jobs together
    max_notebooks: int | None = Field(default=None, ge=1)  # notebooks (kind notebook) waiting or running


class BudgetPeriod(StrEnum):
    MONTH = "month"
    QUARTER = "quarter"


class ExhaustedPolicy(StrEnum):
    """At 100% of a budget: `preemptible_only` refuses new non-preemptible work (reason BudgetExhausted) and lets
    preemptible work in; `approval` holds every new job of the team for an admin's `gpuq approve`."""

    PREEMPTIBLE_ONLY = "preemptible_only"
    APPROVAL = "approval"


class Budget(_Strict):
    """A team's GPU-hours per calendar `period` (UTC), counted by metering from its ledger (allocated GPU-hours of
    the team's jobs in the period). At `warn_at` of it the team is warned (webhook `budget.warning`, alert
    GpuqBudgetNearlySpent); at 100% new work is judged by `on_exhausted`."""

    gpu_hours: float = Field(gt=0, allow_inf_nan=False)
    period: BudgetPeriod = BudgetPeriod.MONTH
    warn_at: float = Field(default=0.8, gt=0, lt=1)
    on_exhausted: ExhaustedPolicy = ExhaustedPolicy.PREEMPTIBLE_ONLY
