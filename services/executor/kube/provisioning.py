"""Capacity that does not exist yet: ProvisioningRequests for the job at the head of a queue that opted in and
waits for nodes the cluster lacks, their answers, and scale-down marks on the nodes gpuq holds no job on
(decisions in services/core/kube/provisioning.py; docs/kubernetes.md, "Capacity")."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from typing import Any

import asyncpg

from services.core.kube import names as n
from services.core.kube import provisioning as core
from services.executor.kube.client import NODE, POD_TEMPLATE, PROVISIONING_REQUEST, KubeApi, status_code
from services.executor.kube.config_in_force import ConfigInForce
from services.executor.kube.informer import Informer
from services.executor.kube.leadership import Seat
from services.executor.kube.nodes import NodeWatch
from services.executor.kube.notices import Notices
from services.executor.kube.records import ref_of, strip_nulls
from shared.config import KubernetesSource, Provisioning
from shared.domain import JobSpec
from shared.events import JobPending
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.executor.kube")



class Capacity:
    def __init__(self, api: KubeApi, cfg: KubernetesSource, seat: Seat, notices: Notices, config: ConfigInForce,
                 nodes: NodeWatch, tick_s: float):
        self.api = api
        self.cfg = cfg
        self.seat = seat
        self.notices = notices
        self.config = config
        self.nodes = nodes
        self.tick_s = tick_s
        self.informer = Informer(api, PROVISIONING_REQUEST, self.on_request, labels={core.MANAGED_BY: "gpuq"},
                                 resync_s=cfg.resync_s, name="provisioningrequests")

    def _provisioning(self, queue: str) -> Provisioning | None:
        q = self.config.queues.queue_map.get(queue)
        return q.provisioning if q is not None else None

    # ------------------------------------------------------------------ asking

    async def on_pending(self, tx: Tx, row: asyncpg.Record, payload: JobPending) -> None:
        """A job's pending status: ask for capacity when it waits for nodes at the head of a queue that opted in
        (once per attempt: a request already asked, or failed and not due again, is left as it is)."""
        spec = JobSpec.model_validate_json(row["spec"])
        provisioning = self._provisioning(payload.queue)
        wants = (row["state"] == "queued" and provisioning is not None and core.opted_in(provisioning, spec)
                 and core.waits_for_capacity(payload.stage, payload.reason, payload.position_in_queue))
        current = await tx.conn.fetchrow("SELECT * FROM executor.kube_provisioning WHERE job_id = $1 FOR UPDATE",
                                         row["job_id"])
        if current is not None:
            await tx.conn.execute("UPDATE executor.kube_provisioning SET wants = $2 WHERE job_id = $1",
                                  row["job_id"], wants)
        if not wants or provisioning is None:
            return
        if current is None:
            await self._ask(tx, row, spec, provisioning, 1)
        elif current["state"] in ("failed", "released") and current["retry_at"] is not None \
                and tx.now >= current["retry_at"]:
            await self._ask(tx, row, spec, provisioning, current["attempt"] + 1)

    async def _ask(self, tx: Tx, row: asyncpg.Record, spec: JobSpec, provisioning: Provisioning,
                   attempt: int) -> None:
        name = core.request_name(row["name"], attempt)
        owner = {"apiVersion": row["api_version"], "kind": row["kind"], "name": row["name"], "uid": row["uid"]}
        objects = core.request_objects(name=name, namespace=row["namespace"], owner=owner, job_id=row["job_id"],
                                       spec=spec, templates=json.loads(row["templates"]), provisioning=provisioning)
        state, reason, message, retry = "requested", "", "", None
        try:
            for tmpl in objects.templates:
                await self._create(POD_TEMPLATE, tmpl, row["namespace"])
            await self._create(PROVISIONING_REQUEST, objects.request, row["namespace"])
        except Exception as exc:
            code = status_code(exc)
            if code not in (403, 404, 422):
                raise  # retried with the unit of work
            state, reason = "failed", "NotCreated"
            message = (f"the cluster serves no {core.API_VERSION} ProvisioningRequest (is the cluster-autoscaler's "
                       "CRD installed?)" if code == 404 else f"creating it was refused: {exc}")
        await tx.conn.execute(
            """INSERT INTO executor.kube_provisioning(job_id, namespace, name, class_name, attempt, state, reason,
                 message, requested_at, retry_at, wants) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, true)
               ON CONFLICT (job_id) DO UPDATE SET name = $3, class_name = $4, attempt = $5, state = $6, reason = $7,
                 message = $8, requested_at = $9, retry_at = $10, wants = true""",
            row["job_id"], row["namespace"], name, provisioning.class_name.value, attempt, state, reason or None,
            message or None, tx.now, retry)
        if state == "failed":
            await self.notices.event(ref_of(row), "ProvisioningFailed", f"{reason}: {message}", tx.now, warning=True)
            return
        await self.notices.event(ref_of(row), "ProvisioningRequested",
                                 f"asked the cluster-autoscaler for capacity: ProvisioningRequest {name} "
                                 f"({provisioning.class_name.value}, attempt {attempt})", tx.now)

    async def _create(self, res: type, obj: dict[str, Any], namespace: str) -> None:
        try:
            await self.api.create(res, strip_nulls(obj), namespace=namespace)
        except Exception as exc:
            if status_code(exc) != 409:  # created before a crash: the same object by its deterministic name
                raise

    # ------------------------------------------------------------------ the autoscaler's answers

    async def on_request(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        job_id = (meta.get("annotations") or {}).get(n.JOB_ID_ANNOTATION)
        if not job_id or kind == "DELETED":
            return
        async with self.seat.transaction() as tx:
            cur = await tx.conn.fetchrow(
                "SELECT p.*, j.api_version, j.kind, j.uid, j.name AS workload, j.spec "
                "FROM executor.kube_provisioning p JOIN executor.kube_jobs j USING (job_id) "
                "WHERE p.job_id = $1 AND p.name = $2 AND p.namespace = $3 "
                "FOR UPDATE OF p", job_id, meta.get("name"), meta.get("namespace"))
            if cur is None or cur["state"] not in ("requested", "provisioned"):
                return
            v = core.verdict(obj)
            if (v.state, v.reason or None, v.message or None) == (cur["state"], cur["reason"], cur["message"]):
                return
            retry = None
            provisioning = self._provisioning(JobSpec.model_validate_json(cur["spec"]).queue)
            if v.state == "failed" and provisioning is not None:
                retry = core.retry_at(tx.now, cur["attempt"] + 1, provisioning)
            await tx.conn.execute(
                "UPDATE executor.kube_provisioning SET state = $2, reason = $3, message = $4, retry_at = $5 "
                "WHERE job_id = $1", job_id, v.state, v.reason or None, v.message or None, retry)
            ref = {"apiVersion": cur["api_version"], "kind": cur["kind"], "namespace": cur["namespace"],
                   "name": cur["workload"], "uid": cur["uid"]}
            said = f"{v.reason}: {v.message}" if v.message else v.reason
            if v.state == "provisioned":
                await self.notices.event(ref, "Provisioned", f"ProvisioningRequest {cur['name']}: {said}", tx.now)
            elif v.state == "failed":
                then = (f"asks again after {_ts(retry)}" if retry is not None
                        else "it is not asked again (retries spent)")
                await self.notices.event(ref, "ProvisioningFailed", f"ProvisioningRequest {cur['name']} failed: "
                                         f"{said}; gpuq stopped waiting for it and {then}", tx.now, warning=True)

    # ------------------------------------------------------------------ the clock: retries, clean-up, scale-down

    async def loop(self, runtime: ServiceRuntime) -> None:
        """Retries, clean-up and scale-down on the clock; and the ProvisioningRequest informer, started once the
        configuration in force has a queue that asks for capacity (a cluster without the autoscaler's CRD, or RBAC
        for it, is never asked to list them otherwise)."""
        await self.nodes.informer.synced.wait()
        watching: asyncio.Task[None] | None = None
        try:
            while True:
                if watching is None and any(q.provisioning for q in self.config.queues.queues):
                    watching = asyncio.create_task(self.informer.run(), name="kube-provisioningrequests")
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("capacity: tick failed; trying again")
                await asyncio.sleep(self.tick_s)
        finally:
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)

    async def tick(self) -> None:
        async with self.seat.transaction() as tx:
            await self._retry(tx)
            await self._release(tx)
            if self.cfg.scale_down_cooldown_s is not None:
                await self._scale_down(tx, self.cfg.scale_down_cooldown_s)

    async def _retry(self, tx: Tx) -> None:
        """A failed request due again, for a job that still waits for capacity and has not run since."""
        rows = await tx.conn.fetch(
            "SELECT j.*, p.attempt AS p_attempt FROM executor.kube_provisioning p JOIN executor.kube_jobs j "
            "USING (job_id) WHERE p.state IN ('failed', 'released') AND p.wants AND p.retry_at <= $1 "
            "AND j.state = 'queued' AND j.uid IS NOT NULL ORDER BY p.job_id FOR UPDATE OF p", tx.now)
        for row in rows:
            spec = JobSpec.model_validate_json(row["spec"])
            provisioning = self._provisioning(spec.queue)
            if provisioning is not None and core.opted_in(provisioning, spec):
                await self._ask(tx, row, spec, provisioning, row["p_attempt"] + 1)

    async def _release(self, tx: Tx) -> None:
        """A job that runs (its pods bound where the capacity is) or ended no longer needs its request: it and its
        PodTemplates are deleted (the workload owns them too, so deleting the workload would)."""
        rows = await tx.conn.fetch(
            "SELECT p.*, j.spec FROM executor.kube_provisioning p JOIN executor.kube_jobs j USING (job_id) "
            "WHERE p.state IN ('requested', 'provisioned', 'failed') AND j.state NOT IN ('queued', 'deferred', "
            "'placed') ORDER BY p.job_id FOR UPDATE OF p")
        for row in rows:
            spec = JobSpec.model_validate_json(row["spec"])
            for res, name in [(PROVISIONING_REQUEST, row["name"]),
                              *((POD_TEMPLATE, core.template_name(row["name"], ps.name)) for ps in spec.pod_sets)]:
                try:
                    await self.api.delete(res, name, namespace=row["namespace"])
                except Exception as exc:
                    if status_code(exc) != 404:
                        raise
            await tx.conn.execute("UPDATE executor.kube_provisioning SET state = 'released', retry_at = NULL "
                                  "WHERE job_id = $1", row["job_id"])

    async def _scale_down(self, tx: Tx, cooldown_s: float) -> None:
        specs = self.nodes.node_specs()
        nodes = [obj for key, obj in sorted(self.nodes.informer.cache.items())
                 if key.lstrip("/") in specs and specs[key.lstrip("/")].gpus > 0]
        busy = set()
        for r in await tx.conn.fetch("SELECT placement FROM executor.kube_jobs WHERE state IN "
                                     "('deferred', 'placed', 'running')"):
            busy |= {b["node"] for b in json.loads(r["placement"] or "[]")}
        idle = {r["node"]: r["since"] for r in await tx.conn.fetch("SELECT node, since FROM executor.kube_node_idle")}
        marks, since = core.scale_down_marks(nodes, busy, idle, tx.now, cooldown_s)
        gone = sorted(set(idle) - set(since))
        if gone:
            await tx.conn.execute("DELETE FROM executor.kube_node_idle WHERE node = ANY($1::text[])", gone)
        fresh = sorted((k, v) for k, v in since.items() if k not in idle)
        if fresh:
            await tx.conn.executemany("INSERT INTO executor.kube_node_idle(node, since) VALUES ($1, $2)", fresh)
        for mark in marks:
            try:
                await self.api.patch(NODE, mark.node, {"metadata": {"annotations": mark.annotations}})
            except Exception as exc:
                if status_code(exc) != 404:
                    log.warning("could not mark node %s for scale-down: %s", mark.node, exc)


async def consumed(tx: Tx, job_id: str, templates: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The placed templates of a job whose request was provisioned, annotated to consume it (Kueue's PodSetUpdates):
    the autoscaler's booked capacity is for these pods."""
    row = await tx.conn.fetchrow("SELECT name, class_name FROM executor.kube_provisioning WHERE job_id = $1 "
                                 "AND state = 'provisioned'", job_id)
    if row is None:
        return templates
    extra = core.consume_annotations(row["name"], row["class_name"])
    out = {}
    for pod_set, tmpl in templates.items():
        meta = dict(tmpl.get("metadata") or {})
        meta["annotations"] = {**(meta.get("annotations") or {}), **extra}
        out[pod_set] = {**tmpl, "metadata": meta}
    return out


def _ts(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
