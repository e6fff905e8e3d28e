"""`executor/kube`: runs gpuq's decisions on a Kubernetes cluster (docs/kubernetes.md).

It honours the simulated executor's protocol (services/executor/sim.py): JobPlaced -> run; JobStarted,
JobCompleted/JobFailed with reasons; CheckpointRequested -> checkpoint annotation on the pods -> JobCheckpointed
from the SDK's answer -> (preemption service) JobPreempted -> suspend; a resumed job gets GPUQ_RESUME_FROM.
It also feeds the platform: NodeInventory/NodeChanged from the node informer, JobSubmitted from suspended workloads
labelled `gpuq.io/queue`, and Kubernetes Events + the `gpuq.io/status` annotation from the jobs' lifecycle events.
With `dcgm` settings it runs the DCGM source (services/executor/dcgm.py) as a background loop and is its
`ExecutorView`: GPU utilisation samples attributed to its jobs' pods, and GPU faults degrading its nodes.

Every decision is written to Postgres with the events it emits, in one transaction (the runtime's outbox); API
calls are made inside that unit of work, so a failed call rolls the decision back and it is retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from lightkube import operators

from services.admission.core import identity
from services.admission.follow import ConfigFollower
from services.eta.core.words import eta_words
from services.executor import fence
from services.executor.attempts import report_failure
from services.executor.core.attribution import Placements
from services.executor.dcgm import DcgmSource, degraded_nodes, ensure_health_table
from services.executor.heartbeat import Heartbeat
from services.executor.kube import inventory
from services.executor.kube.client import NODE, POD, KubeApi, status_code, workload_resource
from services.executor.kube.core import dcgm_view
from services.executor.kube.core import names as n
from services.executor.kube.core.intake import Refusal, job_spec, policy_refusal
from services.executor.kube.core.kinds import all_kinds, kind_of
from services.executor.kube.core.placement import (
    assign_pods,
    event_pod_sets,
    gated,
    placed_templates,
    pod_node,
    restored_template,
    template_gated,
    ungate_patch,
)
from services.executor.kube.core.pods import (
    failure,
    image_pull_problem,
    ready_count,
    rejected,
    requeue_delay_s,
    unschedulable,
)
from services.executor.kube.core.usage import TERMINAL_PHASES, NodeLoads, pod_load
from services.executor.kube.core.workload import (
    Conclusion,
    Finish,
    PodSetTemplate,
    WorkloadKind,
)
from services.executor.kube.informer import Informer, key_of
from services.executor.kube.notices import Notices
from services.executor.kube.webhook import WebhookServer, WebhookSettings
from services.executor.verify import SchedulerTables, verify_placement
from shared import audit
from shared.config import ClusterConfig, DcgmSettings, KubernetesSource, QueuesConfig
from shared.domain import GpuBinding, JobSpec, NodeSpec, PodShape
from shared.events import (
    CheckpointRequested,
    CloudEvent,
    ExitReason,
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobPending,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    PreemptionReason,
    QueueConfigChanged,
    utcnow_from,
)
from shared.service import ServiceRuntime, ServiceSpec, Tx

log = logging.getLogger("gpuq.executor.kube")
MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"
ACTIVE = ("placed", "running")
STOPPED = ("suspended", "failed", "cancelled")  # suspended by gpuq: its templates are restored
ENDED = ("failed", "rejected")  # gpuq's verdict is final: the workload is shown failed (`_conclude`)
BINDING_ANNOTATION = "gpuq.io/binding"  # on a pod: "<attempt>/<binding pod id>" it was given
BOUND_PODS_WAIT_S = 60.0  # how long the first node announcement waits for the bound pods' first list


@dataclass
class KubeExecutorSettings:
    cluster: ClusterConfig
    queues: QueuesConfig
    tick_s: float = 1.0  # wall seconds between timer checks (PodsReady timeout, runtime limit, backoff)
    heartbeat_every_s: float | None = None  # wall seconds between heartbeats (None: GPUQ_HEARTBEAT_INTERVAL_S, 10)
    dcgm: DcgmSettings | None = None  # GPU utilisation and health from dcgm-exporter via Prometheus
    # The admission webhook this process serves (services/executor/kube/webhook.py); None = none. Where it runs,
    # the `gpuq.io/user` annotation is the user of record (the webhook writes it and refuses anyone else's).
    webhook: WebhookSettings | None = None

    @property
    def kube(self) -> KubernetesSource:
        return self.cluster.kube


def _ref(row: asyncpg.Record | dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": row["api_version"], "kind": row["kind"], "namespace": row["namespace"],
            "name": row["name"], "uid": row["uid"]}


def _strip_nulls(value: Any) -> Any:
    """Objects POSTed to the API carry no nulls (a merge patch's null means delete; a create's is invalid)."""
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _bindings(row: asyncpg.Record) -> list[GpuBinding]:
    return [GpuBinding.model_validate(b) for b in json.loads(row["placement"] or "[]")]


def _rfc3339(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _created_at(obj: dict[str, Any]) -> datetime | None:
    raw = (obj.get("metadata") or {}).get("creationTimestamp")
    if not raw:
        return None
    try:
        return datetime.fromisoformat(str(raw).replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


class KubeExecutor:
    def __init__(self, settings: KubeExecutorSettings, api: KubeApi):
        self.scheduler_tables = SchedulerTables()  # placements are checked against the scheduler's table
        self.settings = settings
        self.cfg = settings.kube
        # Namespace mappings, governance and priority classes: admission's version in force (services/admission/
        # follow.py); queues.yaml serves until admission has recorded one.
        self.follower = ConfigFollower("executor", settings.queues)
        self.api = api
        self.notices = Notices(api)
        self.runtime: ServiceRuntime | None = None
        label_exists = {n.QUEUE_LABEL: operators.exists()}
        self.node_informer = Informer(api, NODE, self.on_node, on_synced=self.on_nodes_synced,
                                      resync_s=self.cfg.resync_s, name="nodes")
        self.pod_informer = Informer(api, POD, self.on_pod, labels={n.JOB_LABEL: operators.exists()},
                                     resync_s=self.cfg.resync_s, name="pods")
        # Every pod bound to a node and not finished, in every namespace, gpuq's or not: what the nodes hold.
        self.node_loads = NodeLoads()
        self.bound_pod_informer = Informer(
            api, POD, self.on_bound_pod, fields={"spec.nodeName": operators.not_equal(""),
                                                 "status.phase": operators.not_in(sorted(TERMINAL_PHASES))},
            everywhere=True, resync_s=self.cfg.resync_s, name="bound-pods")
        self.workload_informers = [
            Informer(api, workload_resource(k), self._workload_handler(k), labels=label_exists,
                     resync_s=self.cfg.resync_s, name=k.plural) for k in all_kinds()]
        self._nodes_announced = False
        # Event-submitted jobs whose workload this process is creating: a workload carrying one of their ids before
        # its record commits is gpuq's own, not a claim. Forgotten once the workload is seen bound to the job.
        self._creating: set[str] = set()
        self.dcgm = DcgmSource(settings.dcgm, self) if settings.dcgm is not None else None
        self.heartbeat = Heartbeat("executor/kube", settings.heartbeat_every_s)
        self.webhook: WebhookServer | None = None  # the admission webhook, when this process serves it

    def spec(self) -> ServiceSpec:
        background = (self.watch_cluster, self.timer_loop) + ((self.poll_gpus,) if self.dcgm is not None else ())
        background += (self.webhook.serve,) if self.webhook is not None else ()
        return ServiceSpec(
            name="executor", schema="executor", migrations=MIGRATIONS, singleton=True,  # leader + hot standby
            handlers=fence.fenced({
                JobPlaced: self.on_placed, CheckpointRequested: self.on_checkpoint_requested,
                JobPreempted: self.on_stopped, JobCancelled: self.on_stopped, JobQueued: self.on_status,
                JobPending: self.on_status, JobAdmitted: self.on_status, JobRejected: self.on_status,
                JobRequeued: self.on_status, JobCheckpointed: self.on_checkpointed, JobFailed: self.on_lost},
                lambda: self.runtime) | {QueueConfigChanged: self.on_config_changed},
            on_start=self.start, background=background,
        )

    @property
    def queues(self) -> QueuesConfig:
        return self.follower.config

    async def start(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.notices.instance = runtime.source
        await self.follower.start(runtime)
        self._configure_webhook()
        if self.dcgm is not None:  # the inventory reads the source's verdicts from its first announcement on
            async with runtime.pool.acquire() as conn:
                await ensure_health_table(conn, runtime.spec.schema)

    # ------------------------------------------------------------------ the queue configuration in force

    async def on_config_changed(self, tx: Tx, event: CloudEvent, payload: QueueConfigChanged) -> None:
        """Admission published a version: workloads are judged and jobs created under it from now on."""
        if await self.follower.on_changed(tx, event, payload):
            self._configure_webhook()

    async def _newer_config(self, tx: Tx) -> bool:
        """Before refusing what the configuration decides: is a newer version in force than the one this executor
        runs on? (Its publication travels on another stream than the jobs and workloads it concerns.)"""
        if not await self.follower.refresh(tx.conn):
            return False
        self._configure_webhook()
        return True

    def _config_words(self) -> str:
        version = self.follower.version
        return f"version {version}" if version is not None else "queues.yaml: no version recorded yet"

    def _configure_webhook(self) -> None:
        if self.webhook is not None and self.webhook.policy.queues is not self.queues:
            self.webhook.policy = dataclasses.replace(self.webhook.policy, queues=self.queues)

    # ------------------------------------------------------------------ the DCGM source (ExecutorView)

    async def poll_gpus(self, runtime: ServiceRuntime) -> None:
        """The DCGM source's loop, once the informers have listed nodes and pods: before that, every series would
        name a node or pod this executor does not know yet."""
        assert self.dcgm is not None
        await self.node_informer.synced.wait()
        await self.pod_informer.synced.wait()
        await self.dcgm.run(runtime)

    def node_specs(self) -> Mapping[str, NodeSpec]:
        return inventory.specs(list(self.node_informer.cache.values()), self.cfg, self.node_loads)

    async def placements(self, conn: asyncpg.Connection) -> Placements:
        rows = await conn.fetch("SELECT job_id, job_label, placement, namespace FROM executor.kube_jobs "
                                "WHERE state = 'running' ORDER BY job_id")
        running = [dcgm_view.RunningJob(r["job_id"], r["job_label"], _bindings(r), r["namespace"]) for r in rows]
        return dcgm_view.placements(running, list(self.pod_informer.cache.values()))

    async def node_announced(self, tx: Tx, node: NodeSpec) -> None:
        for name in await inventory.record(tx, node):
            await self._node_failed(tx, name)

    async def _verdicts(self, tx: Tx) -> inventory.Verdicts:
        """The nodes the DCGM source has degraded (none without the source)."""
        return await degraded_nodes(tx.conn, tx.schema) if self.dcgm is not None else inventory.NO_VERDICTS

    # ------------------------------------------------------------------ informers

    async def watch_cluster(self, runtime: ServiceRuntime) -> None:
        """The pods bound to nodes (what others hold there), then nodes (the scheduler needs them before anything
        can run), then gpuq's pods and workloads."""
        tasks = [asyncio.create_task(self.bound_pod_informer.run(), name="kube-bound-pods")]
        try:
            try:  # nodes are first announced with what others hold on them, unless listing pods keeps failing
                await asyncio.wait_for(self.bound_pod_informer.synced.wait(), BOUND_PODS_WAIT_S)
            except TimeoutError:
                log.warning("the pods bound to nodes are not listed after %.0f s: the nodes are announced without "
                            "what pods gpuq does not manage hold there until they are", BOUND_PODS_WAIT_S)
            tasks.append(asyncio.create_task(self.node_informer.run(), name="kube-nodes"))
            await self.node_informer.synced.wait()
            tasks += [asyncio.create_task(i.run(), name=f"kube-{i.name}")
                      for i in (self.pod_informer, *self.workload_informers)]
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.api.close()  # its connections; a leader that takes the lease again watches on new ones

    def _rt(self) -> ServiceRuntime:
        assert self.runtime is not None, "the executor has not started"
        return self.runtime

    # ------------------------------------------------------------------ nodes

    async def on_bound_pod(self, kind: str, pod: dict[str, Any]) -> None:
        """A pod bound to a node changed (bound, finished, gone): the nodes whose load it changed are announced
        again when what others hold there changed."""
        try:
            load = None if kind == "DELETED" else pod_load(pod)
        except ValueError as exc:
            log.warning("ignoring what pod %s holds: %s", key_of(pod), exc)
            load = None
        changed = self.node_loads.put(key_of(pod), load)
        if not changed or not self._nodes_announced:
            return  # before the first announcement, the loads are only recorded: it carries them
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            degraded = await self._verdicts(tx)
            for name in changed:
                obj = self.node_informer.cache.get(f"/{name}")
                if obj is None:
                    continue  # not a node this executor announces (yet)
                for failed in await inventory.publish_node(tx, obj, self.cfg, deleted=False, degraded=degraded,
                                                           loads=self.node_loads):
                    await self._node_failed(tx, failed)

    async def on_node(self, kind: str, obj: dict[str, Any]) -> None:
        if not self._nodes_announced:
            return  # the first list is announced whole by on_nodes_synced
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            changed = await inventory.publish_node(tx, obj, self.cfg, deleted=kind == "DELETED",
                                                   degraded=await self._verdicts(tx), loads=self.node_loads)
            for name in changed:
                await self._node_failed(tx, name)

    async def on_nodes_synced(self, cache: dict[str, dict[str, Any]]) -> None:
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            failed = await inventory.publish_all(tx, list(cache.values()), self.cfg, first=not self._nodes_announced,
                                                 degraded=await self._verdicts(tx), loads=self.node_loads)
            for name in failed:
                await self._node_failed(tx, name)
        self._nodes_announced = True

    async def _node_failed(self, tx: Tx, node: str) -> None:
        """Jobs on a failed or removed node: requeued from their last checkpoint when they can checkpoint,
        else failed with NodeFailure. Their workloads are suspended either way (the pods go)."""
        rows = await tx.conn.fetch(
            "SELECT * FROM executor.kube_jobs WHERE state = ANY($1::text[]) AND placement @> $2::jsonb "
            "ORDER BY job_id FOR UPDATE", list(ACTIVE), json.dumps([{"node": node}]))
        for row in rows:
            spec = JobSpec.model_validate_json(row["spec"])
            message = f"node {node} failed or was removed"
            if spec.checkpoint.supported:
                await self._requeue(tx, row, PreemptionReason.NODE_FAILURE, message, count=False)
            else:
                await self._fail(tx, row, ExitReason.NODE_FAILURE, message + "; the job cannot checkpoint")

    # ------------------------------------------------------------------ workloads (intake and outcome)

    def _workload_handler(self, kind: WorkloadKind) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
        async def handler(event: str, obj: dict[str, Any]) -> None:
            await self.on_workload(kind, event, obj)

        return handler

    async def on_workload(self, kind: WorkloadKind, event: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            # A workload is the job bound to its uid (and namespace) when gpuq took it in or created it, and no other:
            # what its annotations say never attaches it to a job.
            row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE uid = $1 AND namespace = $2 "
                                         "FOR UPDATE", uid, meta.get("namespace"))
            if row is not None:
                self._creating.discard(row["job_id"])
            if event == "DELETED":
                if row is not None and row["state"] in (*ACTIVE, "queued", "deferred", "suspended"):
                    await self._set_state(tx, row["job_id"], "cancelled")
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
                await self._finished(tx, row, finish)
            elif row["state"] in STOPPED:
                await self._restore(kind, row, obj)
            if finish is None and row["state"] in ENDED:
                await self._conclude(tx, kind, row)

    async def _intake(self, tx: Tx, kind: WorkloadKind, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if await tx.conn.fetchval("SELECT true FROM executor.kube_refused WHERE uid = $1", uid):
            return
        ref = {"apiVersion": kind.api_version, "kind": kind.kind, "namespace": meta.get("namespace"),
               "name": meta.get("name"), "uid": uid}
        claimed = (meta.get("annotations") or {}).get(n.JOB_ID_ANNOTATION)
        if claimed is not None:
            if claimed not in self._creating:
                await self._refuse_claim(tx, ref, claimed)
            return  # else gpuq is creating it for that event-submitted job, whose record is being written
        if kind.finished(obj) is not None:
            return  # already over: nothing to schedule
        if not kind.suspended(obj):
            await self._refuse(tx, ref, Refusal(
                "NotSuspended", f"{kind.kind} was created unsuspended, so Kubernetes runs it without gpuq; create it "
                                "with suspend: true to queue it in gpuq"))
            return
        result = job_spec(kind, obj, self.queues, self.cfg, user_of_record=self.settings.webhook is not None)
        if isinstance(result, Refusal) and await self._newer_config(tx):
            result = job_spec(kind, obj, self.queues, self.cfg, user_of_record=self.settings.webhook is not None)
        if isinstance(result, Refusal):
            await self._refuse(tx, ref, result)
            return
        spec = result
        # What its pods would run, judged as an event-submitted job's are (the webhook judged it too, if it ran).
        refusal = policy_refusal(kind, obj, spec, self.queues)
        if refusal is not None and await self._newer_config(tx):
            refusal = policy_refusal(kind, obj, spec, self.queues)
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
        await tx.emit(JobSubmitted(spec=spec, submitted_at=_created_at(obj) or utcnow_from(tx.now)),
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
        mapping = self.queues.namespace_map.get(ref["namespace"])
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

    async def _finished(self, tx: Tx, row: asyncpg.Record, finish: Finish) -> None:
        job_id = row["job_id"]
        now = utcnow_from(tx.now)
        if finish.succeeded:
            await tx.emit(JobCompleted(job_id=job_id, finished_at=now), traceparent=row["traceparent"])
            await self._set_state(tx, job_id, "completed", outcome=ExitReason.SUCCEEDED.value)
            await self.notices.event(_ref(row), "Completed", "the job completed", tx.now)
            await self.notices.status(_ref(row), "Completed")
            return
        pod_failure = json.loads(row["failure"]) if row["failure"] else None
        if finish.reason == "DeadlineExceeded":
            reason, message = ExitReason.DEADLINE_EXCEEDED, finish.message or "activeDeadlineSeconds reached"
        elif pod_failure is not None:
            reason, message = ExitReason(pod_failure["reason"]), pod_failure["message"]
        else:
            reason, message = ExitReason.ERROR, f"{finish.reason}: {finish.message}".strip(": ")
        await self._emit_failed(tx, row, reason, message)

    async def _emit_failed(self, tx: Tx, row: asyncpg.Record, reason: ExitReason, message: str, *,
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
                await self._set_state(tx, row["job_id"], "suspended", outcome=reason.value)
                await self.notices.event(_ref(row), "AttemptFailed", f"{reason.value}: {decision.message}", tx.now,
                                         warning=True)
                await self.notices.status(_ref(row), f"Attempt {decision.attempt} failed: {reason.value}; retrying")
                return
            message = decision.message
        else:
            await tx.emit(JobFailed(job_id=row["job_id"], exit_reason=reason, message=message,
                                    finished_at=utcnow_from(tx.now),
                                    attempts=row["failures"] + 1 if spec.retry is not None else None),
                          traceparent=row["traceparent"])
        await self._set_state(tx, row["job_id"], "failed", outcome=reason.value)
        await self._record_end(tx, row["job_id"], reason.value, message)
        await self.notices.event(_ref(row), "Failed", f"{reason.value}: {message}", tx.now, warning=True)
        await self.notices.status(_ref(row), f"Failed: {reason.value}")

    # ------------------------------------------------------------------ placement

    async def on_placed(self, tx: Tx, event: CloudEvent, placed: JobPlaced) -> None:
        await verify_placement(tx.conn, placed, cancelled_table="executor.cancelled", tables=self.scheduler_tables)
        spec = placed.spec
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", spec.job_id)
        if row is None:
            if spec.workload is None and spec.runnable:
                await self._create_event_job(tx, placed)
            else:
                what = (f"its workload {spec.workload.key} is not known to this executor" if spec.workload
                        else "it has neither a workload reference nor a pod template per pod set")
                await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR,
                                        message=f"cannot run on Kubernetes: {what}", finished_at=utcnow_from(tx.now)))
            return
        if row["state"] in ACTIVE:
            log.warning("%s is placed again while it runs; keeping the running placement", spec.job_id)
            return
        await tx.conn.execute(
            "UPDATE executor.kube_jobs SET spec = $2, placement = $3, resume_from = $4, traceparent = $5 "
            "WHERE job_id = $1", spec.job_id, spec.model_dump_json(),
            json.dumps([b.model_dump(mode="json") for b in placed.bindings]), placed.resume_from, tx.traceparent)
        if row["backoff_until"] is not None and tx.now < row["backoff_until"]:
            await self._set_state(tx, spec.job_id, "deferred")
            return  # the timer runs it when the backoff ends (its GPUs stay reserved meanwhile)
        await self._run(tx, spec.job_id)

    async def _run(self, tx: Tx, job_id: str) -> None:
        """Write the placement into the workload's templates and resume it."""
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", job_id)
        kind = kind_of(row["api_version"], row["kind"])
        assert kind is not None
        spec = JobSpec.model_validate_json(row["spec"])
        res = workload_resource(kind)
        try:
            obj = await self.api.get(res, row["name"], namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) == 404:
                await self._emit_failed(tx, row, ExitReason.ERROR,
                                        f"{row['kind']} {row['namespace']}/{row['name']} no longer exists")
                return
            raise
        originals = [PodSetTemplate(name, 0, tmpl) for name, tmpl in json.loads(row["templates"]).items()]
        templates = placed_templates(originals, spec, _bindings(row), row["resume_from"])
        await self.api.patch(res, row["name"], kind.run_patch(obj, templates), namespace=row["namespace"])
        await tx.conn.execute(
            "UPDATE executor.kube_jobs SET state = 'placed', placed_at = $2, started_at = NULL, attempt = attempt + 1, "
            "failure = NULL, pull_problem_at = NULL, unbound_at = NULL, preemption_id = NULL WHERE job_id = $1",
            job_id, tx.now)
        nodes = sorted({b.node for b in _bindings(row)})
        await self.notices.event(_ref(row), "Placed", f"placed on {', '.join(nodes)}"
                                 + (f"; resuming from {row['resume_from']}" if row["resume_from"] else ""), tx.now)
        await self.notices.status(_ref(row), f"Placed on {len(nodes)} node(s)")

    async def _create_event_job(self, tx: Tx, placed: JobPlaced) -> None:
        """An event-submitted job becomes an Indexed Job (one pod set) or a JobSet (several), created already
        placed (gated templates) and running."""
        spec = placed.spec
        mapped = self.queues.team_namespaces(spec.team)
        if (spec.namespace not in mapped if spec.namespace else not mapped) and await self._newer_config(tx):
            mapped = self.queues.team_namespaces(spec.team)
        namespace = spec.namespace or next(iter(mapped), None)
        if namespace is None:
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                    message=f"no namespace to run in: set spec.namespace or map a namespace to team "
                                            f"{spec.team} in queues.yaml"))
            return
        if namespace not in mapped:
            # Admission refuses such a job; this executor creates with its own rights, so it checks again with the
            # version in force it runs on before creating anything.
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                    message=f"namespace {namespace} is not mapped to team {spec.team} in the "
                                            f"queue configuration in force ({self._config_words()}; namespaces: "
                                            f"{', '.join(mapped) or 'none'}); nothing was created"))
            return
        kind = kind_of("batch/v1", "Job") if len(spec.pod_sets) == 1 else kind_of("jobset.x-k8s.io/v1alpha2", "JobSet")
        assert kind is not None
        pod_sets = event_pod_sets(spec, self.queues.governance.for_team(spec.team).pod_security)
        name = n.dns_name(spec.job_id)
        labels = {n.QUEUE_LABEL: spec.queue}
        annotations = {n.JOB_ID_ANNOTATION: spec.job_id}
        await tx.conn.execute(
            """INSERT INTO executor.kube_jobs(job_id, job_label, origin, api_version, kind, namespace, name, spec,
                 templates, state, placement, resume_from, traceparent)
               VALUES ($1, $2, 'event', $3, $4, $5, $6, $7, $8, 'queued', $9, $10, $11)""",
            spec.job_id, n.job_label(spec.job_id), kind.api_version, kind.kind, namespace, name,
            spec.model_dump_json(), json.dumps({ps.name: ps.template for ps in pod_sets}),
            json.dumps([b.model_dump(mode="json") for b in placed.bindings]), placed.resume_from, tx.traceparent)
        obj = kind.build(name, namespace, pod_sets, labels, annotations)
        res = workload_resource(kind)
        self._creating.add(spec.job_id)  # its workload may be seen before this commits: not a claim (`_intake`)
        try:
            created = await self.api.create(res, _strip_nulls(obj), namespace=namespace)
        except Exception as exc:
            code = status_code(exc)
            if code in (403, 422):  # refused for good (no `create` in the executor's role, an invalid template)
                reason = getattr(getattr(exc, "status", None), "message", None) or str(exc)
                await self._creation_failed(tx, spec.job_id, f"cannot create {kind.kind} {namespace}/{name}: {reason}")
                return
            if code != 409:
                raise
            created = await self.api.get(res, name, namespace=namespace)  # created before a crash: adopt it
            if ((created.get("metadata") or {}).get("annotations") or {}).get(n.JOB_ID_ANNOTATION) != spec.job_id:
                await self._creation_failed(tx, spec.job_id, f"cannot create {kind.kind} {namespace}/{name}: one by "
                                                             "that name exists there and is not this job's")
                return
        # The templates as the API server stored them (defaulted), which later patches must start from, under the
        # spec's pod set names (the placement's bindings name them; a Job's one set is "main" to its kind).
        stored = kind.pod_sets(created)
        await tx.conn.execute("UPDATE executor.kube_jobs SET uid = $2, templates = $3 WHERE job_id = $1", spec.job_id,
                              (created.get("metadata") or {}).get("uid"),
                              json.dumps({wanted.name: ps.template
                                          for wanted, ps in zip(spec.pod_sets, stored, strict=True)}))
        await self._run(tx, spec.job_id)

    async def _creation_failed(self, tx: Tx, job_id: str, message: str) -> None:
        await tx.emit(JobFailed(job_id=job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                message=message))
        await self._set_state(tx, job_id, "failed", outcome=ExitReason.ERROR.value)

    # ------------------------------------------------------------------ pods

    async def on_pod(self, event: str, pod: dict[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        label = labels.get(n.JOB_LABEL)
        if label is None or event == "DELETED":
            return
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_label = $1 AND namespace = $2 "
                                         "FOR UPDATE", label, (pod.get("metadata") or {}).get("namespace"))
            if row is None or row["state"] not in ACTIVE:
                return
            if gated(pod):
                await self._ungate(tx, row, labels.get(n.POD_SET_LABEL, ""))
                return
            await self._observe(tx, row, pod)

    def _job_pods(self, row: asyncpg.Record) -> list[dict[str, Any]]:
        """The job's live pods: carrying its label, in its workload's namespace (a pod elsewhere that copies the
        label is not the job's)."""
        label, namespace = row["job_label"], row["namespace"]
        return sorted((p for p in self.pod_informer.cache.values()
                       if ((p.get("metadata") or {}).get("labels") or {}).get(n.JOB_LABEL) == label
                       and (p.get("metadata") or {}).get("namespace") == namespace
                       and not (p.get("metadata") or {}).get("deletionTimestamp")),
                      key=lambda p: p["metadata"]["name"])

    async def _ungate(self, tx: Tx, row: asyncpg.Record, pod_set: str) -> None:
        """Give every gated pod of the pod set one binding of its set, and remove the gate."""
        spec = JobSpec.model_validate_json(row["spec"])
        attempt = str(row["attempt"])
        pods = [p for p in self._job_pods(row)
                if (p["metadata"].get("labels") or {}).get(n.POD_SET_LABEL) == pod_set]
        taken: dict[str, str] = {}
        for p in pods:
            given = (p["metadata"].get("annotations") or {}).get(BINDING_ANNOTATION, "")
            if given.startswith(f"{attempt}/"):
                taken[given.split("/", 1)[1]] = p["metadata"]["name"]
        by_name = {p["metadata"]["name"]: p for p in pods}
        waiting = [name for name, p in by_name.items() if gated(p)]
        for a in assign_pods(waiting, pod_set, _bindings(row), taken):
            patch = ungate_patch(by_name[a.pod], a.binding.node, spec.tolerations)
            patch["metadata"] = {"annotations": {BINDING_ANNOTATION: f"{attempt}/{a.binding.pod}"}}
            self.pod_informer.remember(await self.api.patch(POD, a.pod, patch, namespace=row["namespace"]))

    async def _observe(self, tx: Tx, row: asyncpg.Record, pod: dict[str, Any]) -> None:
        job_id = row["job_id"]
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        if not (annotations.get(BINDING_ANNOTATION) or "").startswith(f"{row['attempt']}/"):
            return  # a pod of an earlier attempt, on its way out
        uri = annotations.get(n.LAST_CHECKPOINT_ANNOTATION)
        if uri and uri != row["last_checkpoint"]:
            step = annotations.get(n.LAST_CHECKPOINT_STEP_ANNOTATION)
            await tx.conn.execute("UPDATE executor.kube_jobs SET last_checkpoint = $2 WHERE job_id = $1", job_id, uri)
            await tx.emit(JobCheckpointed(job_id=job_id, uri=uri, step=int(step) if step and step.isdigit() else None,
                                          checkpointed_at=utcnow_from(tx.now), preemption_id=row["preemption_id"]),
                          traceparent=row["traceparent"])
        turned_away = rejected(pod)
        if turned_away is not None:  # the node refused it: not the job's failure, the placement's
            reason, said = turned_away
            await self._placement_failed(tx, row, [(pod, reason, said)],
                                         f"pod {pod['metadata']['name']} was rejected by the kubelet of "
                                         f"{pod_node(pod)}: {reason}" + (f": {said}" if said else ""))
            return
        failed = failure(pod)
        if failed is not None and row["failure"] is None:
            await tx.conn.execute("UPDATE executor.kube_jobs SET failure = $2 WHERE job_id = $1", job_id,
                                  json.dumps({"reason": failed.reason.value, "message": failed.message}))
        problem = image_pull_problem(pod)
        if problem is not None and row["pull_problem_at"] is None:
            await tx.conn.execute("UPDATE executor.kube_jobs SET pull_problem_at = $2, failure = $3 WHERE job_id = $1",
                                  job_id, tx.now, json.dumps({"reason": ExitReason.IMAGE_PULL.value,
                                                              "message": problem}))
        why = unschedulable(pod)
        if why is not None and row["unbound_at"] is None:
            # Reported now; requeued by the timer if it lasts (see KubernetesSource.bind_timeout_s).
            message = f"pod {pod['metadata']['name']} cannot run on {pod_node(pod)}: {why}"
            await tx.conn.execute("UPDATE executor.kube_jobs SET unbound_at = $2, unbound_message = $3 "
                                  "WHERE job_id = $1", job_id, tx.now, message)
            await self.notices.event(_ref(row), "Unschedulable", message, tx.now, warning=True)
        elif why is None and row["unbound_at"] is not None and pod.get("spec", {}).get("nodeName"):
            await tx.conn.execute("UPDATE executor.kube_jobs SET unbound_at = NULL WHERE job_id = $1", job_id)
        if row["state"] == "placed":
            spec = JobSpec.model_validate_json(row["spec"])
            if ready_count(self._attempt_pods(row)) >= spec.gang_size:
                await self._started(tx, row, spec)

    def _attempt_pods(self, row: asyncpg.Record) -> list[dict[str, Any]]:
        """The job's live pods given a binding of its current attempt."""
        return [p for p in self._job_pods(row)
                if ((p["metadata"].get("annotations") or {}).get(BINDING_ANNOTATION) or "").startswith(
                    f"{row['attempt']}/")]

    async def _placement_failed(self, tx: Tx, row: asyncpg.Record, refused: list[tuple[dict[str, Any], str, str]],
                                message: str) -> None:
        """Pods that cannot run where gpuq placed them ((pod, reason, message): kube-scheduler left it unschedulable,
        or the kubelet rejected it): each node that refused one is announced refusing pods of that shape until its
        usage changes, and the job is requeued at once, neither backed off nor counted toward `requeue_limit` (that
        is for gangs that were not Ready): the next attempt goes elsewhere, or waits saying which node refused what."""
        spec = JobSpec.model_validate_json(row["spec"])
        sets = {ps.name: ps for ps in spec.pod_sets}
        degraded = await self._verdicts(tx)
        nodes: set[str] = set()
        for pod, reason, why in refused:
            node = pod_node(pod)
            ps = sets.get(((pod.get("metadata") or {}).get("labels") or {}).get(n.POD_SET_LABEL, ""))
            obj = self.node_informer.cache.get(f"/{node}") if node else None
            if node is None or ps is None or obj is None:
                continue
            if await inventory.refuse(tx, obj, self.cfg, job_id=row["job_id"], shape=PodShape.of(ps), reason=reason,
                                      message=why, loads=self.node_loads, degraded=degraded) is not None:
                nodes.add(node)
        note = f"; {', '.join(sorted(nodes))} gets no such pod until what runs there changes" if nodes else ""
        await self._requeue(tx, row, PreemptionReason.PLACEMENT_FAILED, message + note, count=False)

    async def _started(self, tx: Tx, row: asyncpg.Record, spec: JobSpec) -> None:
        nodes = sorted({b.node for b in _bindings(row)})
        await tx.conn.execute("UPDATE executor.kube_jobs SET state = 'running', started_at = $2 WHERE job_id = $1",
                              row["job_id"], tx.now)
        await tx.conn.execute(
            """INSERT INTO executor.runs(job_id, spec, nodes, gpus, status, started_at, ends_at, traceparent)
               VALUES ($1, $2, $3, $4, 'running', $5, $6, $7)
               ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, nodes = excluded.nodes, gpus = excluded.gpus,
                 status = 'running', outcome = NULL, started_at = excluded.started_at, ends_at = excluded.ends_at,
                 attempt = executor.runs.attempt + 1, traceparent = excluded.traceparent""",
            row["job_id"], spec.model_dump_json(), nodes, spec.total_gpus, tx.now, tx.now + spec.max_runtime_s,
            row["traceparent"])
        await tx.emit(JobStarted(job_id=row["job_id"], nodes=tuple(nodes), started_at=utcnow_from(tx.now)),
                      traceparent=row["traceparent"])
        await self.notices.status(_ref(row), f"Running on {len(nodes)} node(s)")

    # ------------------------------------------------------------------ preemption and stops

    async def on_checkpoint_requested(self, tx: Tx, event: CloudEvent, req: CheckpointRequested) -> None:
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", req.job_id)
        if row is None or row["state"] not in ACTIVE:
            return
        await tx.conn.execute("UPDATE executor.kube_jobs SET preemption_id = $2 WHERE job_id = $1", req.job_id,
                              req.preemption_id)
        deadline = req.deadline.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for pod in self._job_pods(row):
            await self.api.patch(POD, pod["metadata"]["name"],
                                 {"metadata": {"annotations": {n.CHECKPOINT_REQUESTED_ANNOTATION: deadline}}},
                                 namespace=row["namespace"])
        await self.notices.event(_ref(row), "CheckpointRequested", f"checkpoint requested before {deadline}", tx.now)

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
        await self._suspend(row)
        if isinstance(payload, JobPreempted):
            await self._set_state(tx, row["job_id"], "suspended", outcome="preempted")
            await self.notices.event(_ref(row), "Preempted", f"{payload.reason.value}"
                                     + (f" by {payload.preemptor}" if payload.preemptor else "")
                                     + (f"; checkpoint {payload.checkpoint_uri}" if payload.checkpoint_uri else ""),
                                     tx.now, warning=True)
        else:
            await self._set_state(tx, row["job_id"], "cancelled", outcome="cancelled")
            await self.notices.event(_ref(row), "Cancelled", f"cancelled by {payload.by}: {payload.reason}", tx.now)

    async def on_lost(self, tx: Tx, event: CloudEvent, payload: JobFailed) -> None:
        """The scheduler declared the job lost (no heartbeat listed it, or it overran its limit): stop its workload,
        as for a failure of its own, so that its GPUs are free here as they are in the scheduler. (Other JobFailed
        events are this executor's own, coming back.)"""
        if payload.exit_reason is not ExitReason.LOST:
            return
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["state"] not in (*ACTIVE, "deferred"):
            return
        await self._suspend(row)
        await self._set_state(tx, row["job_id"], "failed", outcome=ExitReason.LOST.value)
        await self._record_end(tx, row["job_id"], ExitReason.LOST.value, payload.message)
        await self.notices.event(_ref(row), "Lost", payload.message, tx.now, warning=True)
        await self.notices.status(_ref(row), f"Failed: {ExitReason.LOST.value}")

    async def _suspend(self, row: asyncpg.Record) -> None:
        """Suspend the workload: its controller deletes the pods with their grace period. (The templates are given
        back later, once the workload is suspended: see `_restore`.)"""
        kind = kind_of(row["api_version"], row["kind"])
        assert kind is not None
        try:
            await self.api.patch(workload_resource(kind), row["name"], kind.suspend_patch(True),
                                 namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) != 404:  # gone already: nothing left to stop
                raise

    async def _restore(self, kind: WorkloadKind, row: asyncpg.Record, obj: dict[str, Any]) -> None:
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

    async def _requeue(self, tx: Tx, row: asyncpg.Record, reason: PreemptionReason, message: str, *,
                       count: bool = True) -> None:
        """Suspend and hand the job back to admission (JobPreempted -> JobRequeued), resuming from its last
        checkpoint. Counted requeues back off exponentially and end in failure past the limit."""
        requeues = row["requeues"] + (1 if count else 0)
        if count and requeues > self.cfg.requeue_limit:
            await tx.conn.execute("UPDATE executor.kube_jobs SET requeues = $2 WHERE job_id = $1", row["job_id"],
                                  requeues)
            await self._suspend(row)
            await self._emit_failed(tx, row, ExitReason.PODS_NOT_READY,
                                    f"{message}; gave up after {self.cfg.requeue_limit} requeue(s)", retryable=True)
            return
        await self._suspend(row)
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
        await self.notices.event(_ref(row), "Requeued", f"{reason.value}: {message}", tx.now, warning=True)

    async def _fail(self, tx: Tx, row: asyncpg.Record, reason: ExitReason, message: str) -> None:
        """A failure gpuq observed on a live workload: suspended, and retried if the job's policy says so."""
        await self._suspend(row)
        await self._emit_failed(tx, row, reason, message, retryable=True)

    async def _set_state(self, tx: Tx, job_id: str, state: str, outcome: str | None = None) -> None:
        await tx.conn.execute("UPDATE executor.kube_jobs SET state = $2 WHERE job_id = $1", job_id, state)
        if outcome is not None:
            status = outcome if outcome in ("preempted", "cancelled") else (
                "completed" if outcome == ExitReason.SUCCEEDED.value else "failed")
            await tx.conn.execute("UPDATE executor.runs SET status = $2, outcome = $3, ends_at = $4 "
                                  "WHERE job_id = $1 AND status = 'running'", job_id, status, outcome, tx.now)

    async def _record_end(self, tx: Tx, job_id: str, reason: str, message: str) -> None:
        """gpuq's final verdict on the job (it failed, or admission rejected it), for `_conclude`."""
        await tx.conn.execute("UPDATE executor.kube_jobs SET ending = $2::jsonb WHERE job_id = $1", job_id,
                              json.dumps({"reason": reason, "message": message}))

    async def _conclude(self, tx: Tx, kind: WorkloadKind | None, row: asyncpg.Record) -> None:
        """Show Kubernetes the end gpuq gave a job: a workload gpuq failed or admission rejected is suspended, and
        would stay so, never Failed to kubectl or Kueue-aware tools. Once its controller has stopped it (its pods
        are going), it is ended as failed in the kind's own terms (`WorkloadKind.conclusion`: a Job through the
        Job controller, the others with the terminal status their controllers write). Best effort and repeated
        by every sighting of the workload until it reads as finished (a failure here is only logged)."""
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
                await self._restore(kind, row, obj)
                obj = await self.api.get(res, row["name"], namespace=row["namespace"])
            c: Conclusion = kind.conclusion(obj, end["reason"], end["message"], _rfc3339(tx.now))
            if c.status:
                await self.api.patch_status(res, row["name"], c.patch, namespace=row["namespace"])
            else:
                await self.api.patch(res, row["name"], c.patch, namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) != 404:
                log.warning("could not show %s %s/%s as failed: %s", row["kind"], row["namespace"], row["name"], exc)

    # ------------------------------------------------------------------ users' answers

    async def on_status(self, tx: Tx, event: CloudEvent,
                        payload: JobQueued | JobPending | JobAdmitted | JobRejected | JobRequeued) -> None:
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", payload.job_id)
        if row is None or row["uid"] is None:
            return
        if isinstance(payload, JobRejected) and not _refuses_this_job(payload, row):
            return  # a refusal of somebody's later submission of this id, not this job's fate
        reason, message, warning = _notice(payload)
        if isinstance(payload, JobRejected):
            await self._set_state(tx, row["job_id"], "rejected")
            await self._record_end(tx, row["job_id"], "Rejected", f"{payload.reason}: {payload.message}")
        key = f"{reason}|{message}"
        if key == row["last_notice"]:
            return
        await tx.conn.execute("UPDATE executor.kube_jobs SET last_notice = $2 WHERE job_id = $1", row["job_id"], key)
        await self.notices.event(_ref(row), reason, message, tx.now, warning=warning)
        await self.notices.status(_ref(row), f"{reason}: {message}")
        if isinstance(payload, JobRejected):  # never resumed, so stopped already: shown failed now
            await self._conclude(tx, None, row)

    # ------------------------------------------------------------------ timers

    async def timer_loop(self, runtime: ServiceRuntime) -> None:
        self.heartbeat.bus.forget()  # (re)started: heartbeats wait until the executor is caught up with the bus
        while True:
            await self.tick()
            await asyncio.sleep(self.settings.tick_s)

    async def tick(self) -> None:
        """PodsReady timeout, runtime limit, image pull deadline, end of backoff."""
        wall = asyncio.get_running_loop().time()
        # Only while connected and current with the bus, and with Kubernetes: the pods listed once at least.
        beat = self.pod_informer.synced.is_set() and await self.heartbeat.may_send(self._rt(), wall)
        async with self._rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            rows = await tx.conn.fetch(
                "SELECT * FROM executor.kube_jobs WHERE state IN ('deferred', 'placed', 'running') "
                "ORDER BY job_id FOR UPDATE")
            for row in rows:
                await self._check(tx, row)
            if beat:  # what this executor runs, or has placed and is starting
                await self.heartbeat.emit(tx, wall, [r["job_id"] for r in rows if r["state"] in ACTIVE])

    async def _check(self, tx: Tx, row: asyncpg.Record) -> None:
        now, cfg = tx.now, self.cfg
        if row["state"] == "deferred":
            if row["backoff_until"] is None or now >= row["backoff_until"]:
                await self._run(tx, row["job_id"])
            return
        if row["pull_problem_at"] is not None and now - row["pull_problem_at"] >= cfg.image_pull_timeout_s:
            problem = json.loads(row["failure"])["message"] if row["failure"] else "image cannot be pulled"
            await self._fail(tx, row, ExitReason.IMAGE_PULL,
                             f"{problem} (still failing after {cfg.image_pull_timeout_s:g} s)")
            return
        if row["unbound_at"] is not None and now - row["unbound_at"] >= cfg.bind_timeout_s:
            stuck = [(p, "Unschedulable", why) for p in self._attempt_pods(row) if (why := unschedulable(p))]
            await self._placement_failed(tx, row, stuck, f"{row['unbound_message']} (for {cfg.bind_timeout_s:g} s)")
            return
        spec = JobSpec.model_validate_json(row["spec"])
        if row["state"] == "running" and now - row["started_at"] >= spec.max_runtime_s:
            await self._fail(tx, row, ExitReason.DEADLINE_EXCEEDED, f"ran past max_runtime_s={spec.max_runtime_s}")
            return
        if row["state"] == "placed" and now - row["placed_at"] >= cfg.pods_ready_timeout_s:
            ready = ready_count(self._job_pods(row))
            await self._requeue(tx, row, PreemptionReason.PODS_READY_TIMEOUT,
                                f"{ready} of {spec.gang_size} pod(s) Ready after {cfg.pods_ready_timeout_s:g} s")



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


def build_executor(settings: KubeExecutorSettings, kubeconfig: str | Path | None) -> KubeExecutor:
    from services.executor.kube.client import load_config

    if settings.webhook is None:
        settings.webhook = WebhookSettings.from_env()
    executor = KubeExecutor(settings, KubeApi(load_config(kubeconfig), namespace=settings.kube.namespace))
    if settings.webhook is not None:  # its own client: the informers' is closed and reopened with the lease
        executor.webhook = WebhookServer(settings.webhook, settings.queues, KubeApi(load_config(kubeconfig)))
    return executor
