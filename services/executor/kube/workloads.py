"""Users' workloads: a suspended workload labelled `gpuq.io/queue` is taken in as a job (JobSubmitted) or refused
with its reason; a known workload's end, deletion or suspension is followed to its job."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from lightkube import operators

from services.core.kube import names as n
from services.core.kube.intake import Refusal, job_spec, policy_refusal
from services.core.kube.kinds import all_kinds
from services.core.kube.workload import WorkloadKind
from services.executor.kube.client import KubeApi, workload_resource
from services.executor.kube.config_in_force import ConfigInForce
from services.executor.kube.informer import Informer
from services.executor.kube.leadership import Seat
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.records import ACTIVE, ENDED, STOPPED, creation_time
from services.executor.kube.running import Runner
from services.executor.kube.settings import KubeExecutorSettings
from shared import audit
from shared.domain import JobSpec
from shared.events import JobCancelRequested, JobSubmitted, utcnow_from
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class WorkloadIntake:
    def __init__(self, api: KubeApi, settings: KubeExecutorSettings, seat: Seat, notices: Notices,
                 outcomes: Outcomes, config: ConfigInForce, runner: Runner):
        self.settings = settings
        self.cfg = settings.kube
        self.seat = seat
        self.notices = notices
        self.outcomes = outcomes
        self.config = config
        self.runner = runner
        label_exists = {n.QUEUE_LABEL: operators.exists()}
        self.informers = [
            Informer(api, workload_resource(k), self._workload_handler(k), labels=label_exists,
                     resync_s=self.cfg.resync_s, name=k.plural) for k in all_kinds()]

    def _workload_handler(self, kind: WorkloadKind) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
        async def handler(event: str, obj: dict[str, Any]) -> None:
            await self.on_workload(kind, event, obj)

        return handler

    async def on_workload(self, kind: WorkloadKind, event: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        async with self.seat.transaction() as tx:
            # A workload is the job bound to its uid (and namespace) when gpuq took it in or created it, and no other:
            # what its annotations say never attaches it to a job.
            row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE uid = $1 AND namespace = $2 "
                                         "FOR UPDATE", uid, meta.get("namespace"))
            if row is not None:
                self.runner.creating.discard(row["job_id"])
            if event == "DELETED":
                if row is not None and row["state"] in (*ACTIVE, "queued", "deferred", "suspended"):
                    await self.outcomes.set_state(tx, row["job_id"], "cancelled")
                    # A request, on the job's team's subject: admission checks it and publishes JobCancelled.
                    team = JobSpec.model_validate_json(row["spec"]).team
                    await tx.emit(JobCancelRequested(job_id=row["job_id"], requested_by="kubernetes",
                                                     reason=f"{kind.kind} {meta.get('name')} was deleted",
                                                     requested_at=utcnow_from(tx.now)), subject_suffix=team)
                return
            if row is None:
                await self._intake(tx, kind, obj)
                return
            finish = kind.finished(obj)
            if finish is not None and row["state"] in ACTIVE:
                await self.outcomes.finished(tx, row, finish)
            elif row["state"] in STOPPED:
                await self.outcomes.restore(kind, row, obj)
            if finish is None and row["state"] in ENDED:
                await self.outcomes.conclude(tx, kind, row)

    async def take_in(self, tx: Tx, kind: WorkloadKind, obj: dict[str, Any]) -> None:
        """Take in a held object of `kind` that has no job yet (plain pods: services/executor/kube/plainpods.py)."""
        await self._intake(tx, kind, obj)

    async def refuse(self, tx: Tx, ref: dict[str, Any], reason: str, message: str) -> None:
        await self._refuse(tx, ref, Refusal(reason, message))

    async def _intake(self, tx: Tx, kind: WorkloadKind, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if await tx.conn.fetchval("SELECT true FROM executor.kube_refused WHERE uid = $1", uid):
            return
        ref = {"apiVersion": kind.api_version, "kind": kind.kind, "namespace": meta.get("namespace"),
               "name": meta.get("name"), "uid": uid}
        claimed = (meta.get("annotations") or {}).get(n.JOB_ID_ANNOTATION)
        if claimed is not None:
            if claimed not in self.runner.creating:
                await self._refuse_claim(tx, ref, claimed)
            return  # else gpuq is creating it for that event-submitted job, whose record is being written
        if kind.finished(obj) is not None:
            return  # already over: nothing to schedule
        if not kind.suspended(obj):
            await self._refuse(tx, ref, Refusal(
                "NotSuspended", f"{kind.kind} was created unsuspended, so Kubernetes runs it without gpuq; create it "
                                "with suspend: true to queue it in gpuq"))
            return
        # DRA nodes known: the workload's GPU pod sets (device-plugin resources) are kept off them
        dra_nodes = bool(self.runner.nodes is not None and self.runner.nodes.devices)
        result = job_spec(kind, obj, self.config.queues, self.cfg, user_of_record=self.settings.webhook is not None,
                          dra_nodes=dra_nodes)
        if isinstance(result, Refusal) and await self.config.newer(tx):
            result = job_spec(kind, obj, self.config.queues, self.cfg,
                              user_of_record=self.settings.webhook is not None, dra_nodes=dra_nodes)
        if isinstance(result, Refusal):
            await self._refuse(tx, ref, result)
            return
        spec = result
        # What its pods would run, judged as an event-submitted job's are (the webhook judged it too, if it ran).
        refusal = policy_refusal(kind, obj, spec, self.config.queues)
        if refusal is not None and await self.config.newer(tx):
            refusal = policy_refusal(kind, obj, spec, self.config.queues)
        if refusal is not None:
            await self._refuse(tx, ref, refusal)
            return
        templates = {ps.name: ps.template for ps in kind.pod_sets(obj)}
        inserted = await tx.conn.fetchval(
            """INSERT INTO executor.kube_jobs(job_id, job_label, origin, api_version, kind, namespace, name, uid, spec,
                 templates, state) VALUES ($1, $2, 'cluster', $3, $4, $5, $6, $7, $8, $9, 'queued')
               ON CONFLICT (job_id) DO NOTHING RETURNING true""",
            spec.job_id, n.job_label(spec.job_id), kind.api_version, kind.kind, ref["namespace"], ref["name"], uid,
            spec.model_dump_json(), json.dumps(templates))
        if not inserted:
            return
        # On the team's subject (the team mapped from the namespace): the executor's bus user may publish there.
        await tx.emit(JobSubmitted(spec=spec, submitted_at=creation_time(obj) or utcnow_from(tx.now)),
                      subject_suffix=spec.team)
        await self.notices.event(ref, "Submitted", f"gpuq job {spec.job_id}: team {spec.team}, queue {spec.queue}, "
                                                   f"priority {spec.priority_class}, {spec.total_gpus} GPU(s)", tx.now)
        await self.notices.status(ref, f"Submitted as {spec.job_id}")

    async def _refuse_claim(self, tx: Tx, ref: dict[str, Any], claimed: str) -> None:
        """A workload bound to no job that names one in gpuq's own annotation: refused (once, an Event on it) and
        audited for the team of its namespace. Said in the same words whether that job exists or not, whoever's it
        is, so that the answer tells nothing of another team's jobs."""
        await self._refuse(tx, ref, Refusal(
            "JobIdClaimed", f"annotation {n.JOB_ID_ANNOTATION}={claimed!r} is written by gpuq only, on the workloads "
                            "it creates: a workload is the job gpuq bound to its uid, and this one is bound to none. "
                            f"gpuq leaves it alone; create it again without the annotation (suspended, labelled "
                            f"{n.QUEUE_LABEL}) to queue it"))
        mapping = self.config.queues.namespace_map.get(ref["namespace"])
        await audit.record(tx, "workload_refused", f"namespace:{ref['namespace']}",
                           team=mapping.team if mapping is not None else None, reason="JobIdClaimed",
                           claimed_job_id=claimed, workload=f"{ref['kind']} {ref['namespace']}/{ref['name']}",
                           uid=ref["uid"])

    async def _refuse(self, tx: Tx, ref: dict[str, Any], refusal: Refusal) -> None:
        await tx.conn.execute(
            "INSERT INTO executor.kube_refused(uid, reason, message, at) VALUES ($1, $2, $3, $4) "
            "ON CONFLICT DO NOTHING", ref["uid"], refusal.reason, refusal.message, tx.now)
        log.info("refused %s %s/%s: %s: %s", ref["kind"], ref["namespace"], ref["name"], refusal.reason,
                 refusal.message)
        await self.notices.event(ref, refusal.reason, refusal.message, tx.now, warning=True)
        await self.notices.status(ref, f"Refused: {refusal.reason}: {refusal.message}")
