"""gpuq's pods: each gated pod given one binding of its pod set and ungated, then watched for what it tells of the
job (a checkpoint written, a failure, an image that cannot be pulled, a pod the node will not run) until the gang
is Ready and the job has started."""

from __future__ import annotations

import json
import logging
from typing import Any

import asyncpg
from lightkube import operators

from services.core.kube import dra
from services.core.kube import names as n
from services.core.kube.elastic import placed_counts, target_annotations
from services.core.kube.placement import assign_pods, gated, pod_node, ungate_patch
from services.core.kube.pods import failure, image_pull_problem, ready_count, rejected, unschedulable
from services.executor.kube import inventory
from services.executor.kube.client import POD, KubeApi
from services.executor.kube.devices import RESOURCE_CLAIM
from services.executor.kube.informer import Informer
from services.executor.kube.leadership import Seat
from services.executor.kube.nodes import NodeWatch
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.records import ACTIVE, BINDING_ANNOTATION, bindings_of, ref_of
from shared.config import KubernetesSource
from shared.domain import GpuBinding, JobSpec, PodShape
from shared.events import ExitReason, JobCheckpointed, JobStarted, PreemptionReason, utcnow_from
from shared.service import Tx

log = logging.getLogger("gpuq.executor.kube")


class PodWatch:
    def __init__(self, api: KubeApi, cfg: KubernetesSource, seat: Seat, notices: Notices, outcomes: Outcomes,
                 nodes: NodeWatch):
        self.api = api
        self.cfg = cfg
        self.seat = seat
        self.notices = notices
        self.outcomes = outcomes
        self.nodes = nodes
        self.informer = Informer(api, POD, self.on_pod, labels={n.JOB_LABEL: operators.exists()},
                                 resync_s=cfg.resync_s, name="pods")

    async def on_pod(self, event: str, pod: dict[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        label = labels.get(n.JOB_LABEL)
        if label is None or event == "DELETED":
            return
        async with self.seat.transaction() as tx:
            row = await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE job_label = $1 AND namespace = $2 "
                                         "FOR UPDATE", label, (pod.get("metadata") or {}).get("namespace"))
            if row is None or row["state"] not in ACTIVE:
                return
            if gated(pod):
                await self._ungate(tx, row, labels.get(n.POD_SET_LABEL, ""))
                return
            await self._observe(tx, row, pod)

    def job_pods(self, row: asyncpg.Record) -> list[dict[str, Any]]:
        """The job's live pods: carrying its label, in its workload's namespace (a pod elsewhere that copies the
        label is not the job's)."""
        label, namespace = row["job_label"], row["namespace"]
        return sorted((p for p in self.informer.cache.values()
                       if ((p.get("metadata") or {}).get("labels") or {}).get(n.JOB_LABEL) == label
                       and (p.get("metadata") or {}).get("namespace") == namespace
                       and not (p.get("metadata") or {}).get("deletionTimestamp")),
                      key=lambda p: p["metadata"]["name"])

    async def _ungate(self, tx: Tx, row: asyncpg.Record, pod_set: str) -> None:
        """Give every gated pod of the pod set one binding of its set, and remove the gate."""
        spec = JobSpec.model_validate_json(row["spec"])
        attempt = str(row["attempt"])
        pods = [p for p in self.job_pods(row)
                if (p["metadata"].get("labels") or {}).get(n.POD_SET_LABEL) == pod_set]
        taken: dict[str, str] = {}
        for p in pods:
            given = (p["metadata"].get("annotations") or {}).get(BINDING_ANNOTATION, "")
            if given.startswith(f"{attempt}/"):
                taken[given.split("/", 1)[1]] = p["metadata"]["name"]
        by_name = {p["metadata"]["name"]: p for p in pods}
        waiting = [name for name, p in by_name.items() if gated(p)]
        # an elastic job's pod is told the size it joins (a resize's notice may have missed a pod being created)
        notes = target_annotations(spec, placed_counts(spec, bindings_of(row))) if spec.elastic else {}
        for a in assign_pods(waiting, pod_set, bindings_of(row), taken):
            if dra.asks_claim(by_name[a.pod]) and not await self._allocate(row, by_name[a.pod], a.binding):
                continue  # its claim is not made yet: ungated when the controller has made it (a pod update)
            patch = ungate_patch(by_name[a.pod], a.binding.node, spec.tolerations)
            patch["metadata"] = {"annotations": {**notes, BINDING_ANNOTATION: f"{attempt}/{a.binding.pod}"}}
            self.informer.remember(await self.api.patch(POD, a.pod, patch, namespace=row["namespace"]))

    async def _allocate(self, row: asyncpg.Record, pod: dict[str, Any], binding: GpuBinding) -> bool:
        """DRA: the devices of the pod's binding written into the pod's own ResourceClaim as its allocation result,
        before its gate is removed (kube-scheduler then binds it where they are). False while the resourceclaim
        controller has not made the claim yet."""
        claim_name = dra.pod_claim(pod)
        if claim_name is None:
            return False
        claim = await self.api.get(RESOURCE_CLAIM, claim_name, namespace=row["namespace"])
        if dra.allocated(claim):
            return True
        try:
            status = dra.allocation(binding, self.nodes.devices.get(binding.node, ()))
        except ValueError as exc:
            # The node no longer publishes those devices (or never did: a later attempt placed elsewhere). The pod
            # is ungated with its claim unallocated: kube-scheduler allocates it there or leaves the pod
            # unschedulable, which requeues the job and makes the node refuse such pods (bind_timeout_s).
            log.warning("pod %s: %s; its claim %s is left to kube-scheduler", pod["metadata"]["name"], exc,
                        claim_name)
            return True
        await self.api.patch_status(RESOURCE_CLAIM, claim_name, status, namespace=row["namespace"])
        return True

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
            await self.placement_failed(tx, row, [(pod, reason, said)],
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
            await self.notices.event(ref_of(row), "Unschedulable", message, tx.now, warning=True)
        elif why is None and row["unbound_at"] is not None and pod.get("spec", {}).get("nodeName"):
            await tx.conn.execute("UPDATE executor.kube_jobs SET unbound_at = NULL WHERE job_id = $1", job_id)
        if row["state"] == "placed":
            spec = JobSpec.model_validate_json(row["spec"])
            if ready_count(self.attempt_pods(row)) >= spec.gang_size:
                await self._started(tx, row, spec)

    def attempt_pods(self, row: asyncpg.Record) -> list[dict[str, Any]]:
        """The job's live pods given a binding of its current attempt."""
        return [p for p in self.job_pods(row)
                if ((p["metadata"].get("annotations") or {}).get(BINDING_ANNOTATION) or "").startswith(
                    f"{row['attempt']}/")]

    async def placement_failed(self, tx: Tx, row: asyncpg.Record, refused: list[tuple[dict[str, Any], str, str]],
                               message: str) -> None:
        """Pods that cannot run where gpuq placed them ((pod, reason, message): kube-scheduler left it unschedulable,
        or the kubelet rejected it): each node that refused one is announced refusing pods of that shape until its
        usage changes, and the job is requeued at once, neither backed off nor counted toward `requeue_limit` (that
        is for gangs that were not Ready): the next attempt goes elsewhere, or waits saying which node refused what."""
        spec = JobSpec.model_validate_json(row["spec"])
        sets = {ps.name: ps for ps in spec.pod_sets}
        degraded = await self.nodes.verdicts(tx)
        nodes: set[str] = set()
        for pod, reason, why in refused:
            node = pod_node(pod)
            ps = sets.get(((pod.get("metadata") or {}).get("labels") or {}).get(n.POD_SET_LABEL, ""))
            obj = self.nodes.informer.cache.get(f"/{node}") if node else None
            if node is None or ps is None or obj is None:
                continue
            if await inventory.refuse(tx, obj, self.cfg, job_id=row["job_id"], shape=PodShape.of(ps), reason=reason,
                                      message=why, loads=self.nodes.loads, degraded=degraded,
                                      devices=self.nodes.devices) is not None:
                nodes.add(node)
        note = f"; {', '.join(sorted(nodes))} gets no such pod until what runs there changes" if nodes else ""
        await self.outcomes.requeue(tx, row, PreemptionReason.PLACEMENT_FAILED, message + note, count=False)

    async def _started(self, tx: Tx, row: asyncpg.Record, spec: JobSpec) -> None:
        nodes = sorted({b.node for b in bindings_of(row)})
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
        await self.notices.status(ref_of(row), f"Running on {len(nodes)} node(s)")
