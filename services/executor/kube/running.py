"""Placement carried out: a placed job's workload gets its templates restricted to the chosen nodes and is resumed;
an event-submitted job first becomes a workload (an Indexed Job, or a JobSet for several pod sets)."""

from __future__ import annotations

import json
import logging

import asyncpg

from services.core.kube import dra
from services.core.kube import names as n
from services.core.kube.elastic import run_elastic
from services.core.kube.kinds import kind_of
from services.core.kube.placement import (
    event_pod_sets,
    isolation_note,
    nodes_by_pod_set,
    placed_templates,
    set_sharing,
)
from services.core.kube.workload import PodSetTemplate
from services.executor.kube.client import KubeApi, status_code, workload_resource
from services.executor.kube.config_in_force import ConfigInForce
from services.executor.kube.devices import RESOURCE_CLAIM_TEMPLATE
from services.executor.kube.nodes import NodeWatch
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.plainpods import end_job, plain_row, start_pods
from services.executor.kube.provisioning import consumed
from services.executor.kube.records import ACTIVE, bindings_of, ref_of, strip_nulls
from services.executor.verify import SchedulerTables, verify_placement
from shared.domain import GpuSharing, JobSpec, NodeSpec, SharingMode
from shared.events import CloudEvent, ExitReason, JobFailed, JobPlaced, utcnow_from
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class Runner:
    def __init__(self, api: KubeApi, notices: Notices, outcomes: Outcomes, config: ConfigInForce,
                 scheduler_tables: SchedulerTables, nodes: NodeWatch | None = None):
        self.api = api
        self.nodes = nodes  # the nodes' DRA devices
        self.notices = notices
        self.outcomes = outcomes
        self.config = config
        self.scheduler_tables = scheduler_tables  # placements are checked against the scheduler's table
        # Event-submitted jobs whose workload this process is creating: a workload carrying one of their ids before
        # its record commits is gpuq's own, not a claim. Forgotten once the workload is seen bound to the job.
        self.creating: set[str] = set()

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
            await self.outcomes.set_state(tx, spec.job_id, "deferred")
            return  # the timer runs it when the backoff ends (its GPUs stay reserved meanwhile)
        await self.run(tx, spec.job_id)

    async def run(self, tx: Tx, job_id: str) -> None:
        """Write the placement into the workload's templates and resume it."""
        row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_id = $1 FOR UPDATE", job_id)
        if plain_row(row):  # plain pods: labelled for the pod watch, which gives them their nodes and ungates them
            gone = await start_pods(self.api, row, JobSpec.model_validate_json(row["spec"]))
            if gone is not None:
                await end_job(tx, self.api, self.notices, self.outcomes, row, gone)
                return
            await self._placed(tx, row)
            return
        kind = kind_of(row["api_version"], row["kind"])
        assert kind is not None
        spec = JobSpec.model_validate_json(row["spec"])
        res = workload_resource(kind)
        try:
            obj = await self.api.get(res, row["name"], namespace=row["namespace"])
        except Exception as exc:
            if status_code(exc) == 404:
                await self.outcomes.emit_failed(tx, row, ExitReason.ERROR,
                                                f"{row['kind']} {row['namespace']}/{row['name']} no longer exists")
                return
            raise
        originals = [PodSetTemplate(name, 0, tmpl) for name, tmpl in json.loads(row["templates"]).items()]
        templates = placed_templates(originals, spec, bindings_of(row), row["resume_from"])
        templates = await consumed(tx, job_id, templates)  # the autoscaler's booked capacity, when it provisioned
        # an elastic workload runs the pods placed, and its pods are told how many (services/core/kube/elastic.py)
        patch = (run_elastic(kind, obj, spec, bindings_of(row), templates) if spec.elastic
                 else kind.run_patch(obj, templates))
        await self.api.patch(res, row["name"], patch, namespace=row["namespace"])
        await self._placed(tx, row)

    async def _placed(self, tx: Tx, row: asyncpg.Record) -> None:
        """The job's workload was started where it was placed: a new attempt, said on the workload."""
        await tx.conn.execute(
            "UPDATE executor.kube_jobs SET state = 'placed', placed_at = $2, started_at = NULL, attempt = attempt + 1, "
            "failure = NULL, pull_problem_at = NULL, unbound_at = NULL, preemption_id = NULL WHERE job_id = $1",
            row["job_id"], tx.now)
        nodes = sorted({b.node for b in bindings_of(row)})
        await self.notices.event(ref_of(row), "Placed", f"placed on {', '.join(nodes)}"
                                 + (f"; resuming from {row['resume_from']}" if row["resume_from"] else ""), tx.now)
        await self.notices.status(ref_of(row), f"Placed on {len(nodes)} node(s)")

    async def _create_event_job(self, tx: Tx, placed: JobPlaced) -> None:
        """An event-submitted job becomes an Indexed Job (one pod set) or a JobSet (several), created already
        placed (gated templates) and running."""
        spec = placed.spec
        namespace = await self._namespace_for(tx, spec)
        if namespace is None:
            return
        kind = kind_of("batch/v1", "Job") if len(spec.pod_sets) == 1 else kind_of("jobset.x-k8s.io/v1alpha2", "JobSet")
        assert kind is not None
        sharing = set_sharing(spec, placed.bindings, await self._sharing_of(tx, placed))
        try:
            pod_sets = event_pod_sets(spec, self.config.queues.governance.for_team(spec.team).pod_security, sharing,
                                      pool_label=self.nodes.cfg.pool_label if self.nodes is not None else None)
        except ValueError as exc:  # a shared pod set placed where no node (as this executor knows it) shares GPUs
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                    message=f"cannot run on Kubernetes: {exc}"))
            return
        name = n.dns_name(spec.job_id)
        dra_sets = self._dra_pod_sets(spec, placed)  # their GPUs from a claim each pod gets, not nvidia.com/gpu
        pod_sets = [PodSetTemplate(ps.name, ps.count, dra.with_claim(ps.template,
                                                                     dra.claim_template_name(name, ps.name)))
                    if ps.name in dra_sets else ps for ps in pod_sets]
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
        self.creating.add(spec.job_id)  # its workload may be seen before this commits: not a claim (WorkloadIntake)
        try:
            created = await self.api.create(res, strip_nulls(obj), namespace=namespace)
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
        ref = {"apiVersion": kind.api_version, "kind": kind.kind, "namespace": namespace, "name": name,
               "uid": (created.get("metadata") or {}).get("uid")}
        for pod_set, gpus in sorted(dra_sets.items()):  # DRA: each pod's claim is made from its set's template
            owner = {"apiVersion": kind.api_version, "kind": kind.kind, "name": name, "uid": ref["uid"],
                     "controller": False, "blockOwnerDeletion": False}
            body = dra.claim_template(dra.claim_template_name(name, pod_set), namespace, gpus, owner)
            try:
                await self.api.create(RESOURCE_CLAIM_TEMPLATE, body, namespace=namespace)
            except Exception as exc:
                if status_code(exc) != 409:  # made before a crash: kept
                    raise
        for pod_set, (how, nodes) in sorted(sharing.items()):
            # Said where `kubectl describe` shows it: time-slicing gives no isolation at all.
            await self.notices.event(ref, "GpuNotIsolated" if how.mode is SharingMode.TIME_SLICING else "GpuShared",
                                     isolation_note(pod_set, how, nodes), tx.now,
                                     warning=how.mode is SharingMode.TIME_SLICING)
        await self.run(tx, spec.job_id)

    def _dra_pod_sets(self, spec: JobSpec, placed: JobPlaced) -> dict[str, int]:
        """The whole-GPU pod sets placed on nodes whose GPUs are DRA devices (by name: GPUs per pod)."""
        devices = self.nodes.devices if self.nodes is not None else {}
        by_set = nodes_by_pod_set(placed.bindings)
        return {ps.name: ps.gpus_per_pod for ps in spec.pod_sets
                if ps.gpus and not ps.shared and any(devices.get(node) for node in by_set.get(ps.name, []))}

    async def _sharing_of(self, tx: Tx, placed: JobPlaced) -> dict[str, GpuSharing | None]:
        """How the nodes of a placement share their GPUs, as this executor last announced them."""
        if not any(ps.shared for ps in placed.spec.pod_sets):
            return {}
        rows = await tx.conn.fetch("SELECT name, spec FROM executor.kube_nodes WHERE name = ANY($1::text[]) "
                                   "ORDER BY name", sorted({b.node for b in placed.bindings}))
        return {r["name"]: NodeSpec.model_validate_json(r["spec"]).sharing for r in rows}

    async def _namespace_for(self, tx: Tx, spec: JobSpec) -> str | None:
        """The namespace an event-submitted job's workload is created in: its own, or its team's first; None (the
        job failed, said why) when the queue configuration in force maps none, or not that one, to its team."""
        mapped = self.config.queues.team_namespaces(spec.team)
        if (spec.namespace not in mapped if spec.namespace else not mapped) and await self.config.newer(tx):
            mapped = self.config.queues.team_namespaces(spec.team)
        namespace = spec.namespace or next(iter(mapped), None)
        if namespace is None:
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                    message=f"no namespace to run in: set spec.namespace or map a namespace to team "
                                            f"{spec.team} in queues.yaml"))
            return None
        if namespace not in mapped:
            # Admission refuses such a job; this executor creates with its own rights, so it checks again with the
            # version in force it runs on before creating anything.
            await tx.emit(JobFailed(job_id=spec.job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                    message=f"namespace {namespace} is not mapped to team {spec.team} in the "
                                            f"queue configuration in force ({self.config.words()}; namespaces: "
                                            f"{', '.join(mapped) or 'none'}); nothing was created"))
            return None
        return namespace

    async def _creation_failed(self, tx: Tx, job_id: str, message: str) -> None:
        await tx.emit(JobFailed(job_id=job_id, exit_reason=ExitReason.ERROR, finished_at=utcnow_from(tx.now),
                                message=message))
        await self.outcomes.set_state(tx, job_id, "failed", outcome=ExitReason.ERROR.value)
