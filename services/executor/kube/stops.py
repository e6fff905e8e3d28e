"""Stops gpuq decides elsewhere: the checkpoint protocol's request (an annotation on the job's pods, answered by
the SDK), a checkpoint the job published itself, and a preemption, cancellation or loss that suspends the
workload."""

from __future__ import annotations

from datetime import UTC

from services.core.kube import names as n
from services.executor.kube.client import POD, KubeApi
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.pods import PodWatch
from services.executor.kube.records import ACTIVE, ref_of
from shared.events import (
    CheckpointRequested,
    CloudEvent,
    ExitReason,
    JobCancelled,
    JobCheckpointed,
    JobFailed,
    JobPreempted,
)
from shared.service import Tx


class Stops:
    def __init__(self, api: KubeApi, notices: Notices, outcomes: Outcomes, pods: PodWatch):
        self.api = api
        self.notices = notices
        self.outcomes = outcomes
        self.pods = pods

    async def on_checkpoint_requested(self, tx: Tx, event: CloudEvent, req: CheckpointRequested) -> None:
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", req.job_id)
        if row is None or row["state"] not in ACTIVE:
            return
        await tx.conn.execute("UPDATE executor.kube_jobs SET preemption_id = $2 WHERE job_id = $1", req.job_id,
                              req.preemption_id)
        deadline = req.deadline.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pod in self.pods.job_pods(row):
            await self.api.patch(POD, pod["metadata"]["name"],
                                 {"metadata": {"annotations": {n.CHECKPOINT_REQUESTED_ANNOTATION: deadline}}},
                                 namespace=row["namespace"])
        await self.notices.event(ref_of(row), "CheckpointRequested", f"checkpoint requested before {deadline}", tx.now)

    async def on_checkpointed(self, tx: Tx, event: CloudEvent, payload: JobCheckpointed) -> None:
        """A job may publish JobCheckpointed itself instead of using the SDK: remember it (a node failure requeues
        the job from its last checkpoint)."""
        await tx.conn.execute("UPDATE executor.kube_jobs SET last_checkpoint = $2 WHERE job_id = $1",
                              payload.job_id, payload.uri)

    async def on_stopped(self, tx: Tx, event: CloudEvent, payload: JobPreempted | JobCancelled) -> None:
        if isinstance(payload, JobCancelled):  # remembered even before the job's placement arrives
            await tx.conn.execute("INSERT INTO executor.cancelled(job_id, at) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                                  payload.job_id, tx.now)
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["state"] not in (*ACTIVE, "deferred", "queued"):
            return
        await self.outcomes.suspend(row)
        if isinstance(payload, JobPreempted):
            await self.outcomes.set_state(tx, row["job_id"], "suspended", outcome="preempted")
            await self.notices.event(ref_of(row), "Preempted", f"{payload.reason.value}"
                                     + (f" by {payload.preemptor}" if payload.preemptor else "")
                                     + (f"; checkpoint {payload.checkpoint_uri}" if payload.checkpoint_uri else ""),
                                     tx.now, warning=True)
        else:
            await self.outcomes.set_state(tx, row["job_id"], "cancelled", outcome="cancelled")
            await self.notices.event(ref_of(row), "Cancelled", f"cancelled by {payload.by}: {payload.reason}", tx.now)

    async def on_lost(self, tx: Tx, event: CloudEvent, payload: JobFailed) -> None:
        """The scheduler declared the job lost (no heartbeat listed it, or it overran its limit): stop its workload,
        as for a failure of its own, so that its GPUs are free here as they are in the scheduler. (Other JobFailed
        events are this executor's own, coming back.)"""
        if payload.exit_reason is not ExitReason.LOST:
            return
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["state"] not in (*ACTIVE, "deferred"):
            return
        await self.outcomes.suspend(row)
        await self.outcomes.set_state(tx, row["job_id"], "failed", outcome=ExitReason.LOST.value)
        await self.outcomes.record_end(tx, row["job_id"], ExitReason.LOST.value, payload.message)
        await self.notices.event(ref_of(row), "Lost", payload.message, tx.now, warning=True)
        await self.notices.status(ref_of(row), f"Failed: {ExitReason.LOST.value}")
