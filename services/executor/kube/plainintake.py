"""Plain pods' intake (services/core/kube/kinds/pod.py): a held pod labelled `gpuq.io/queue` that no controller owns
is taken in as a job, a group of them once all its pods exist; the job ends when its pods end or are deleted (a
deleted plain pod is not recreated: plainpods.py)."""

from __future__ import annotations

from typing import Any

import asyncpg
from lightkube import operators

from services.core.kube import names as n
from services.core.kube.kinds import pod as kpod
from services.core.kube.workload import meta_of as _meta
from services.executor.kube.client import POD, KubeApi
from services.executor.kube.informer import Informer
from services.executor.kube.leadership import Seat
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.plainpods import OPEN, delete_pods, end_job
from services.executor.kube.records import ACTIVE
from services.executor.kube.workloads import WorkloadIntake
from shared.config import KubernetesSource
from shared.service import Tx


class PlainPodIntake:
    """The plain pods' informer: intake, end and deletion of their jobs."""

    def __init__(self, api: KubeApi, cfg: KubernetesSource, seat: Seat, notices: Notices, outcomes: Outcomes,
                 intake: WorkloadIntake):
        self.api = api
        self.seat = seat
        self.notices = notices
        self.outcomes = outcomes
        self.intake = intake
        self.informer = Informer(api, POD, self.on_pod, labels={n.QUEUE_LABEL: operators.exists()},
                                 resync_s=cfg.resync_s, name="plain-pods")

    async def on_pod(self, event: str, pod: dict[str, Any]) -> None:
        if not kpod.plain(pod):
            return  # a workload's pod (its controller's), judged with that workload
        group = kpod.group_of(pod)
        gone = event == "DELETED" or kpod.terminating(pod)
        async with self.seat.transaction() as tx:
            row = await self._row(tx, pod, group)
            if row is not None:
                await self._follow(tx, row, pod, gone)
                return
            if gone or kpod.bound_to(pod) is not None or kpod.pod_finish(pod) is not None:
                return  # the pod of a job that ended, or one that never needed gpuq
            if group is None:
                if await self._held(tx, pod, pod):
                    await self.intake.take_in(tx, kpod.PLAIN_POD, pod)
                return
            await self._group_intake(tx, pod, group)

    async def _row(self, tx: Tx, pod: dict[str, Any], group: str | None) -> asyncpg.Record | None:
        meta = _meta(pod)
        if group is None:
            # A pod is the job bound to its uid (and namespace), whatever its annotations say.
            return await tx.conn.fetchrow("SELECT * FROM executor.kube_jobs WHERE uid = $1 AND namespace = $2 "
                                          "AND api_version = 'v1' AND kind = $3 FOR UPDATE", meta.get("uid"),
                                          meta.get("namespace"), kpod.POD_KIND)
        row = await tx.conn.fetchrow(
            "SELECT * FROM executor.kube_jobs WHERE api_version = 'v1' AND kind = $1 AND namespace = $2 AND name = $3 "
            "AND state = ANY($4::text[]) ORDER BY job_id LIMIT 1 FOR UPDATE", kpod.GROUP_KIND, meta.get("namespace"),
            group, list(OPEN))
        if row is not None and kpod.bound_to(pod) not in (None, row["job_id"]):
            return None  # a pod of an earlier job of that group
        return row

    def _group_pods(self, namespace: str, group: str, job_id: str | None) -> list[dict[str, Any]]:
        """The group's live pods in the cache: bound to `job_id` (or, None, to no job yet)."""
        return [p for p in self.informer.cache.values()
                if _meta(p).get("namespace") == namespace and kpod.group_of(p) == group and kpod.plain(p)
                and not kpod.terminating(p) and kpod.bound_to(p) == job_id]

    async def _group_intake(self, tx: Tx, pod: dict[str, Any], group: str) -> None:
        namespace = _meta(pod).get("namespace") or ""
        state = kpod.group_object(group, [p for p in self._group_pods(namespace, group, None)
                                          if kpod.pod_finish(p) is None])
        if state.obj is None and state.problem is None:
            return  # pods still to come: taken in, all or nothing, once all exist
        if state.obj is None:
            lead = min(self._group_pods(namespace, group, None), key=lambda p: str(_meta(p).get("name")),
                       default=pod)
            ref = {**_ref(lead), "kind": kpod.GROUP_KIND, "name": group}
            if not await tx.conn.fetchval("SELECT true FROM executor.kube_refused WHERE uid = $1",
                                          _meta(lead).get("uid")):
                await self.intake.refuse(tx, ref, "InvalidPodGroup", state.problem or "")
            return
        if await self._held(tx, state.obj, pod):
            await self.intake.take_in(tx, kpod.POD_GROUP, state.obj)

    async def _held(self, tx: Tx, obj: dict[str, Any], pod: dict[str, Any]) -> bool:
        """Whether every pod of the job to be carries gpuq's gate; else it runs without gpuq (no webhook gated it)
        and is refused once, saying how to queue it."""
        if kpod.PLAIN_POD.suspended(obj):
            return True
        meta = _meta(obj)
        if await tx.conn.fetchval("SELECT true FROM executor.kube_refused WHERE uid = $1", meta.get("uid")):
            return False
        ref = _ref(pod) if "pods" not in obj else {**_ref(pod), "kind": kpod.GROUP_KIND, "name": meta.get("name")}
        await self.intake.refuse(tx, ref, "NotGated", f"pod(s) created without gpuq's scheduling gate "
                                                      f"{n.PLACEMENT_GATE} run without gpuq; create them with it "
                                                      "(gpuq's admission webhook adds it in the namespaces it manages)")
        return False

    async def _follow(self, tx: Tx, row: asyncpg.Record, pod: dict[str, Any], gone: bool) -> None:
        name = _meta(pod).get("name")
        if gone and kpod.pod_finish(pod) is None:
            if row["state"] not in OPEN:
                return
            if row["state"] == "suspended":
                why = (f"pod {name} was deleted when gpuq stopped the job (preempted or requeued): a plain pod cannot "
                       "be suspended and nothing recreates it, so the job ends")
            else:
                why = f"pod {name} was deleted"
            await end_job(tx, self.api, self.notices, self.outcomes, row, why)
            return
        if row["state"] not in ACTIVE:
            return
        if row["kind"] == kpod.POD_KIND:
            finish = kpod.pod_finish(pod)
        else:
            finish = kpod.POD_GROUP.finished({"pods": self._group_pods(row["namespace"], row["name"], row["job_id"])})
        if finish is None:
            return
        await self.outcomes.finished(tx, row, finish)
        if row["kind"] == kpod.GROUP_KIND and not finish.succeeded:
            await delete_pods(self.api, row)  # the rest of a gang one of whose pods failed


def _ref(pod: dict[str, Any]) -> dict[str, Any]:
    meta = _meta(pod)
    return {"apiVersion": "v1", "kind": kpod.POD_KIND, "namespace": meta.get("namespace"), "name": meta.get("name"),
            "uid": meta.get("uid")}
