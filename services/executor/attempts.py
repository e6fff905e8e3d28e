"""A failed attempt, as both executors report it: retried (JobAttemptFailed) or final (JobFailed).

The executor that observes a failure owns the count of the job's failed attempts (a column of its own table,
written in the transaction that emits the event), and applies the one retry rule of the pipeline core
(`services.core.pipeline.decide_retry`) to the job's `retry` policy. A redelivered or replayed observation
cannot count twice: the count and the event are one transaction, and the run's status leaves 'running' in it.
"""

from __future__ import annotations

from services.core.pipeline import RetryDecision, decide_retry
from shared.domain import JobSpec
from shared.events import ExitReason, JobAttemptFailed, JobFailed, utcnow_from
from shared.service import Tx


async def report_failure(tx: Tx, spec: JobSpec, failures_before: int, reason: ExitReason, message: str, *,
                         lost_gpu_seconds: float = 0.0, checkpoint_uri: str | None = None,
                         traceparent: str | None = None) -> RetryDecision:
    """Emit what follows the failure of the job's attempt number `failures_before + 1`; the caller stores the new
    count (`failures_before + 1`) in the same transaction."""
    decision = decide_retry(spec.retry, failures_before + 1, reason.value, message, tx.now)
    finished = utcnow_from(tx.now)
    if decision.retry:
        assert decision.not_before is not None
        await tx.emit(JobAttemptFailed(
            job_id=spec.job_id, attempt=decision.attempt, attempts_allowed=decision.attempts_allowed,
            exit_reason=reason, message=decision.message, finished_at=finished,
            retry_not_before=utcnow_from(decision.not_before), checkpoint_uri=checkpoint_uri,
            lost_gpu_seconds=max(0.0, lost_gpu_seconds)), traceparent=traceparent)
    else:
        await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=reason, message=decision.message,
                                finished_at=finished, attempts=decision.attempt if spec.retry is not None else None),
                      traceparent=traceparent)
    return decision
