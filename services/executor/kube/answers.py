"""Admission's answers shown on the workload where its user looks (`kubectl describe`): queued, pending with its
position and expected start, admitted, rejected (which ends the job), requeued; and idle reclaim's warning
(telemetry's JobIdleWarned: a Warning Event `GpuIdle`)."""

from __future__ import annotations

from typing import Any

import asyncpg

from services.core.admission import identity
from services.core.eta.words import eta_words
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.provisioning import Capacity
from services.executor.kube.records import ACTIVE, ref_of
from shared.domain import JobSpec
from shared.events import (
    CloudEvent,
    JobAdmitted,
    JobIdleWarned,
    JobPending,
    JobQueued,
    JobRejected,
    JobRequeued,
)
from shared.service import Tx

IDLE_REASON = "GpuIdle"


class Answers:
    def __init__(self, notices: Notices, outcomes: Outcomes, capacity: Capacity | None = None):
        self.notices = notices
        self.outcomes = outcomes
        self.capacity = capacity  # asks the cluster-autoscaler for a job waiting for nodes

    async def on_status(self, tx: Tx, event: CloudEvent,
                        payload: JobQueued | JobPending | JobAdmitted | JobRejected | JobRequeued) -> None:
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["uid"] is None:
            return
        if isinstance(payload, JobRejected) and not _refuses_this_job(payload, row):
            return  # a refusal of somebody's later submission of this id, not this job's fate
        if isinstance(payload, JobPending) and self.capacity is not None:
            await self.capacity.on_pending(tx, row, payload)
        reason, message, warning = _notice(payload)
        if isinstance(payload, JobRejected):
            await self.outcomes.set_state(tx, row["job_id"], "rejected")
            await self.outcomes.record_end(tx, row["job_id"], "Rejected", f"{payload.reason}: {payload.message}")
        key = f"{reason}|{message}"
        if key == row["last_notice"]:
            return
        await tx.conn.execute("UPDATE executor.kube_jobs SET last_notice = $2 WHERE job_id = $1", row["job_id"], key)
        await self.notices.event(ref_of(row), reason, message, tx.now, warning=warning)
        await self.notices.status(ref_of(row), f"{reason}: {message}")
        if isinstance(payload, JobRejected):  # never resumed, so stopped already: shown failed now
            await self.outcomes.conclude(tx, None, row)


    async def on_idle_warned(self, tx: Tx, event: CloudEvent, payload: JobIdleWarned) -> None:
        """The owner's warning that the job's GPUs are idle and when it is reclaimed, as a Warning Event on its
        workload while it runs (the message names the threshold, the idle time and the grace)."""
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1", payload.job_id)
        if row is None or row["uid"] is None or row["state"] not in ACTIVE:
            return
        deadline = payload.deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
        await self.notices.event(ref_of(row), IDLE_REASON, f"{payload.message} (reclaimed at {deadline})", tx.now,
                                 warning=True)


def _refuses_this_job(payload: JobRejected, row: asyncpg.Record) -> bool:
    """Is a JobRejected the verdict on this workload's own submission? Admission also refuses, under the same id, a
    later submission of it (the team's own duplicate) and another team's attempt to take the id, rate-limited or not:
    those verdicts travel with the submitter's team and say nothing of this job, which must keep running. Only a job
    still waiting for its verdict can be rejected, and only by a verdict for its own team."""
    if payload.reason in (identity.DUPLICATE_JOB_ID, identity.JOB_ID_UNAVAILABLE) or row["state"] != "queued":
        return False
    return payload.team is None or payload.team == JobSpec.model_validate_json(row["spec"]).team


def _notice(payload: Any) -> tuple[str, str, bool]:
    """(Event reason, message, warning?) for a lifecycle event a user should see on the workload."""
    if isinstance(payload, JobPending):
        where = []
        if payload.position_in_queue is not None:
            where.append(f"position {payload.position_in_queue} in queue {payload.queue}")
        if payload.position_in_cohort is not None:
            where.append(f"{payload.position_in_cohort} in its cohort")
        if payload.eta is not None:  # in `gpuq explain`'s words (each time zoned), the same start and range
            low, high = payload.eta_low, payload.eta_high
            where.append("expected start " + eta_words(payload.eta.timestamp(), low.timestamp() if low else None,
                                                       high.timestamp() if high else None))
        suffix = f" ({', '.join(where)})" if where else ""
        return "Pending", f"{payload.reason}: {payload.message}{suffix}", False
    if isinstance(payload, JobQueued):
        pos = f", position {payload.position}" if payload.position is not None else ""
        return "Queued", f"queued in {payload.queue}{pos}", False
    if isinstance(payload, JobAdmitted):
        flavors = ", ".join(f"{k}={v}" for k, v in sorted(payload.flavors.items()))
        text = "admitted, borrowing quota" if payload.borrowing else "admitted"
        return "Admitted", text + (f" (flavors {flavors})" if flavors else ""), False
    if isinstance(payload, JobRejected):
        return "Rejected", f"{payload.reason}: {payload.message}", True
    if isinstance(payload, JobRequeued):
        return "Requeued", "back in the queue" + (f", resuming from {payload.resume_from}" if payload.resume_from
                                                  else ""), False
    raise TypeError(type(payload).__name__)
