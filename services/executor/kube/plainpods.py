"""Plain pods (services/core/kube/kinds/pod.py): their jobs are started by labelling the pods (the pod watch then
gives each its node and removes the gate, as for every gpuq pod) and stopped by deleting them. Their intake and end
are plainintake.py's.

A pod cannot be suspended, and nothing recreates a plain pod gpuq deleted: a job whose pods are deleted (by their
user, or by gpuq when it was preempted or requeued) ends there, cancelled, its reason saying which. A group's job
that ends deletes what is left of the group."""

from __future__ import annotations

import logging
from typing import Any, Protocol

import asyncpg

from services.core.kube import names as n
from services.core.kube.kinds import pod as kpod
from services.core.kube.workload import meta_of as _meta
from services.executor.kube.client import POD, KubeApi, status_code
from services.executor.kube.notices import Notices
from services.executor.kube.records import ACTIVE, ref_of
from shared.domain import JobSpec
from shared.events import JobCancelRequested, utcnow_from
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")
OPEN = (*ACTIVE, "queued", "deferred", "suspended")  # states in which the job still has its pods to come or run


class States(Protocol):
    """Where a job's state is recorded (Outcomes.set_state)."""

    async def set_state(self, tx: Tx, job_id: str, state: str, outcome: str | None = None) -> None: ...


def plain_row(row: asyncpg.Record | dict[str, Any]) -> bool:
    return kpod.kind_of_record(row["api_version"], row["kind"]) is not None


async def job_pods(api: KubeApi, row: asyncpg.Record) -> list[dict[str, Any]]:
    """The live pods of a plain-pod job as the API has them now: its pod (the same uid), or its group's pods that
    are its own or not yet bound to any job."""
    if row["kind"] == kpod.POD_KIND:
        try:
            pod = await api.get(POD, row["name"], namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) == 404:
                return []
            raise
        return [pod] if _meta(pod).get("uid") == row["uid"] else []
    pods, _ = await api.list(POD, labels={n.POD_GROUP_LABEL: row["name"]})
    return sorted((p for p in pods if _meta(p).get("namespace") == row["namespace"] and kpod.plain(p)
                   and kpod.bound_to(p) in (None, row["job_id"])), key=lambda p: str(_meta(p).get("name")))


async def start_pods(api: KubeApi, row: asyncpg.Record, spec: JobSpec) -> str | None:
    """Bind the job's held pods to it (`kpod.start_patch`), each in its pod set; the pod watch then places and
    ungates them. A reason when they cannot be started: the pod, or one of the group's, is gone."""
    pods = [p for p in await job_pods(api, row) if not kpod.terminating(p) and kpod.pod_finish(p) is None]
    wanted = sum(ps.count for ps in spec.pod_sets)
    if len(pods) < wanted:
        what = f"pod {row['namespace']}/{row['name']}" if row["kind"] == kpod.POD_KIND \
            else f"pod group {row['namespace']}/{row['name']} ({len(pods)} of {wanted} pods left)"
        return f"{what} was deleted before it could start: a plain pod is not recreated, so the job ends"
    names = kpod.pod_set_names(pods)
    for pod in pods:
        await api.patch(POD, _meta(pod)["name"], kpod.start_patch(row["job_id"], names[_meta(pod)["name"]],
                                                                 row["resume_from"]), namespace=row["namespace"])
    return None


async def delete_pods(api: KubeApi, row: asyncpg.Record) -> None:
    """Stop a plain-pod job: its pods deleted, each with its grace period (the checkpoint request, when the job's
    class asks for one, came before)."""
    for pod in await job_pods(api, row):
        if kpod.terminating(pod) or kpod.pod_finish(pod) is not None:
            continue
        try:
            await api.delete(POD, _meta(pod)["name"], namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) != 404:
                raise


async def end_job(tx: Tx, api: KubeApi, notices: Notices, outcomes: States, row: asyncpg.Record,
                  why: str) -> None:
    """A plain-pod job whose pods are gone ends: cancelled (asked of admission, which publishes JobCancelled), what
    is left of a group deleted."""
    stopped = row["state"] == "suspended"  # gpuq deleted it (preempted or requeued): the run says preempted already
    await outcomes.set_state(tx, row["job_id"], "cancelled", outcome=None if stopped else "cancelled")
    if row["kind"] == kpod.GROUP_KIND:
        await delete_pods(api, row)
    team = JobSpec.model_validate_json(row["spec"]).team
    await tx.emit(JobCancelRequested(job_id=row["job_id"], requested_by="kubernetes", reason=why,
                                     requested_at=utcnow_from(tx.now)), subject_suffix=team)
    await notices.event(ref_of(row), "Ended", why, tx.now, warning=stopped)
