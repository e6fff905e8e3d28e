"""What becomes of a job on Kubernetes once gpuq has decided or observed its end: its state and run recorded, its
workload suspended (or given its templates back), the job requeued or failed, and the end shown on the workload.

Every outcome is written in the caller's unit of work with the events it emits; the API calls it makes are in that
unit too, so a failed call rolls the decision back and it is retried."""

from __future__ import annotations

import json
import logging
from typing import Any

import asyncpg

from services.core.kube.kinds import kind_of
from services.core.kube.placement import restored_template, template_gated
from services.core.kube.pods import requeue_delay_s
from services.core.kube.workload import Conclusion, Finish, WorkloadKind
from services.executor.attempts import report_failure
from services.executor.kube.client import KubeApi, status_code, workload_resource
from services.executor.kube.notices import Notices
from services.executor.kube.plainpods import delete_pods, plain_row
from services.executor.kube.records import ENDED, ref_of, rfc3339
from shared.config import KubernetesSource
from shared.domain import JobSpec
from shared.events import ExitReason, JobCompleted, JobFailed, JobPreempted, PreemptionReason, utcnow_from
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class Outcomes:
    """A job's transitions out of running (finished, failed, requeued, stopped) and how the workload shows them."""

    def __init__(self, api: KubeApi, notices: Notices, cfg: KubernetesSource):
        self.api = api
        self.notices = notices
        self.cfg = cfg

    async def set_state(self, tx: Tx, job_id: str, state: str, outcome: str | None = None) -> None:
        await tx.conn.execute("UPDATE executor.kube_jobs SET state = $2 WHERE job_id = $1", job_id, state)
        if outcome is not None:
            status = outcome if outcome in ("preempted", "cancelled") else (
                "completed" if outcome == ExitReason.SUCCEEDED.value else "failed")
            await tx.conn.execute("UPDATE executor.runs SET status = $2, outcome = $3, ends_at = $4 "
                                  "WHERE job_id = $1 AND status = 'running'", job_id, status, outcome, tx.now)

    async def record_end(self, tx: Tx, job_id: str, reason: str, message: str) -> None:
        """gpuq's final verdict on the job (it failed, or admission rejected it), for `conclude`."""
        await tx.conn.execute("UPDATE executor.kube_jobs SET ending = $2::jsonb WHERE job_id = $1", job_id,
                              json.dumps({"reason": reason, "message": message}))

    async def suspend(self, row: asyncpg.Record) -> None:
        """Suspend the workload: its controller deletes the pods with their grace period. (The templates are given
        back later, once the workload is suspended: see `restore`.)"""
        if plain_row(row):  # a pod cannot be suspended: it is deleted (and its job ends: plainpods.py)
            await delete_pods(self.api, row)
            return
        kind = kind_of(row["api_version"], row["kind"])
        assert kind is not None
        try:
            await self.api.patch(workload_resource(kind), row["name"], kind.suspend_patch(True),
                                 namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) != 404:  # gone already: nothing left to stop
                raise

    async def restore(self, kind: WorkloadKind, row: asyncpg.Record, obj: dict[str, Any]) -> None:
        """Give a suspended workload its templates back as the user wrote them (Kueue's restore), once the API
        allows it: a Job's template changes only while it is suspended and not started, so this waits for the
        controller to have stopped it (status.startTime cleared)."""
        if not kind.suspended(obj) or (obj.get("status") or {}).get("startTime"):
            return
        if not any(template_gated(ps.template) for ps in kind.pod_sets(obj)):
            return  # nothing of gpuq's left
        originals = {name: restored_template(t) for name, t in json.loads(row["templates"]).items()}
        try:
            await self.api.patch(workload_resource(kind), row["name"], kind.run_patch(obj, originals, suspend=True),
                                 namespace=row["namespace"])
        except Exception as exc:  # best effort: the next placement replaces the templates anyway
            log.warning("could not restore the templates of %s: %s", row["job_id"], exc)

    async def requeue(self, tx: Tx, row: asyncpg.Record, reason: PreemptionReason, message: str, *,
                      count: bool = True) -> None:
        """Suspend and hand the job back to admission (JobPreempted -> JobRequeued), resuming from its last
        checkpoint. Counted requeues back off exponentially and end in failure past the limit."""
        requeues = row["requeues"] + (1 if count else 0)
        if count and requeues > self.cfg.requeue_limit:
            await tx.conn.execute("UPDATE executor.kube_jobs SET requeues = $2 WHERE job_id = $1", row["job_id"],
                                  requeues)
            await self.suspend(row)
            await self.emit_failed(tx, row, ExitReason.PODS_NOT_READY,
                                   f"{message}; gave up after {self.cfg.requeue_limit} requeue(s)", retryable=True)
            return
        await self.suspend(row)
        backoff = tx.now + requeue_delay_s(requeues, self.cfg.requeue_backoff_s) if count else None
        await tx.conn.execute("UPDATE executor.kube_jobs SET state = 'suspended', requeues = $2, backoff_until = $3 "
                              "WHERE job_id = $1", row["job_id"], requeues, backoff)
        await tx.conn.execute("UPDATE executor.runs SET status = 'preempted', ends_at = $2 WHERE job_id = $1 "
                              "AND status = 'running'", row["job_id"], tx.now)
        lost = (tx.now - row["started_at"]) * JobSpec.model_validate_json(row["spec"]).total_gpus \
            if row["started_at"] else 0.0
        await tx.emit(JobPreempted(job_id=row["job_id"], reason=reason, checkpoint_uri=row["last_checkpoint"],
                                   lost_gpu_seconds=lost, preempted_at=utcnow_from(tx.now)),
                      traceparent=row["traceparent"])
        await self.notices.event(ref_of(row), "Requeued", f"{reason.value}: {message}", tx.now, warning=True)

    async def fail(self, tx: Tx, row: asyncpg.Record, reason: ExitReason, message: str) -> None:
        """A failure gpuq observed on a live workload: suspended, and retried if the job's policy says so."""
        await self.suspend(row)
        await self.emit_failed(tx, row, reason, message, retryable=True)

    async def emit_failed(self, tx: Tx, row: asyncpg.Record, reason: ExitReason, message: str, *,
                          retryable: bool = False) -> None:
        """The attempt failed. `retryable`: the workload is suspended, not finished, so the job's retry policy
        may run it again (JobAttemptFailed; admission re-admits it after its backoff and the next placement
        resumes the workload). Otherwise (Kubernetes marked the workload Failed, or it is gone) the end is final."""
        spec = JobSpec.model_validate_json(row["spec"])
        if retryable:
            lost = (tx.now - row["started_at"]) * spec.total_gpus if row["started_at"] else 0.0
            decision = await report_failure(tx, spec, row["failures"], reason, message, lost_gpu_seconds=lost,
                                            checkpoint_uri=row["last_checkpoint"], traceparent=row["traceparent"])
            await tx.conn.execute("UPDATE executor.kube_jobs SET failures = $2 WHERE job_id = $1", row["job_id"],
                                  row["failures"] + 1)
            if decision.retry:
                # a new attempt gets the PodsReady requeues an attempt may use afresh
                await tx.conn.execute("UPDATE executor.kube_jobs SET requeues = 0, backoff_until = NULL "
                                      "WHERE job_id = $1", row["job_id"])
                await self.set_state(tx, row["job_id"], "suspended", outcome=reason.value)
                await self.notices.event(ref_of(row), "AttemptFailed", f"{reason.value}: {decision.message}", tx.now,
                                         warning=True)
                await self.notices.status(ref_of(row), f"Attempt {decision.attempt} failed: {reason.value}; retrying")
                return
            message = decision.message
        else:
            await tx.emit(JobFailed(job_id=row["job_id"], exit_reason=reason, message=message,
                                    finished_at=utcnow_from(tx.now),
                                    attempts=row["failures"] + 1 if spec.retry is not None else None),
                          traceparent=row["traceparent"])
        await self.set_state(tx, row["job_id"], "failed", outcome=reason.value)
        await self.record_end(tx, row["job_id"], reason.value, message)
        await self.notices.event(ref_of(row), "Failed", f"{reason.value}: {message}", tx.now, warning=True)
        await self.notices.status(ref_of(row), f"Failed: {reason.value}")

    async def conclude(self, tx: Tx, kind: WorkloadKind | None, row: asyncpg.Record) -> None:
        """Show Kubernetes the end gpuq gave a job: a workload gpuq failed or admission rejected is suspended, and
        would stay so, never Failed to kubectl or Kueue-aware tools. Once its controller has stopped it (its pods
        are going), it is ended as failed in the kind's own terms (`WorkloadKind.conclusion`: a Job through the
        Job controller, the others with the terminal status their controllers write). Best effort and repeated
        by every sighting of the workload until it reads as finished (a failure here is only logged)."""
        if plain_row(row):
            return  # a pod's status is its kubelet's: a rejected plain pod stays held, the reason on its Event
        current = await tx.conn.fetchrow("SELECT state, ending FROM executor.kube_jobs WHERE job_id = $1",
                                         row["job_id"])
        if row["uid"] is None or current is None or current["state"] not in ENDED or current["ending"] is None:
            return
        end = json.loads(current["ending"])
        kind = kind or kind_of(row["api_version"], row["kind"])
        assert kind is not None
        res = workload_resource(kind)
        try:
            obj = await self.api.get(res, row["name"], namespace=row["namespace"])  # its status now, not as seen
            if ((obj.get("metadata") or {}).get("uid")) != row["uid"]:
                return  # another workload by that name
            if kind.finished(obj) is not None or not kind.stopped(obj):
                return
            if any(template_gated(ps.template) for ps in kind.pod_sets(obj)):
                # the user's templates back first: a Job's may change only while it is suspended and not started
                await self.restore(kind, row, obj)
                obj = await self.api.get(res, row["name"], namespace=row["namespace"])
            c: Conclusion = kind.conclusion(obj, end["reason"], end["message"], rfc3339(tx.now))
            if c.status:
                await self.api.patch_status(res, row["name"], c.patch, namespace=row["namespace"])
            else:
                await self.api.patch(res, row["name"], c.patch, namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) != 404:
                log.warning("could not show %s %s/%s as failed: %s", row["kind"], row["namespace"], row["name"], exc)

    async def finished(self, tx: Tx, row: asyncpg.Record, finish: Finish) -> None:
        job_id = row["job_id"]
        now = utcnow_from(tx.now)
        if finish.succeeded:
            await tx.emit(JobCompleted(job_id=job_id, finished_at=now), traceparent=row["traceparent"])
            await self.set_state(tx, job_id, "completed", outcome=ExitReason.SUCCEEDED.value)
            await self.notices.event(ref_of(row), "Completed", "the job completed", tx.now)
            await self.notices.status(ref_of(row), "Completed")
            return
        pod_failure = json.loads(row["failure"]) if row["failure"] else None
        if finish.reason == "DeadlineExceeded":
            reason, message = ExitReason.DEADLINE_EXCEEDED, finish.message or "activeDeadlineSeconds reached"
        elif pod_failure is not None:
            reason, message = ExitReason(pod_failure["reason"]), pod_failure["message"]
        else:
            reason, message = ExitReason.ERROR, f"{finish.reason}: {finish.message}".strip(": ")
        await self.emit_failed(tx, row, reason, message)
