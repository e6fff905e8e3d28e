"""Spot interruption notices: the jobs on a node the cloud is about to reclaim get a checkpoint request at once
(the checkpoint protocol's pod annotation, which the SDK answers), then are requeued from that checkpoint
(decisions in services/core/kube/interruption.py; docs/kubernetes.md, "Spot")."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from services.core.kube import interruption
from services.core.kube import names as n
from services.executor.kube.client import POD, KubeApi, status_code
from services.executor.kube.leadership import Seat
from services.executor.kube.notices import Notices
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.pods import PodWatch
from services.executor.kube.records import ACTIVE, ref_of, rfc3339
from shared.config import KubernetesSource
from shared.domain import JobSpec
from shared.events import PreemptionReason
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.executor.kube")


class Interruptions:
    def __init__(self, api: KubeApi, cfg: KubernetesSource, seat: Seat, notices: Notices, outcomes: Outcomes,
                 pods: PodWatch, tick_s: float):
        self.api = api
        self.cfg = cfg
        self.seat = seat
        self.notices = notices
        self.outcomes = outcomes
        self.pods = pods
        self.tick_s = tick_s

    async def on_node(self, tx: Tx, node: dict[str, Any]) -> None:
        """A node changed: if it carries an interruption notice, its jobs not told yet are, and those that can
        checkpoint are asked for one before `interruption_checkpoint_s` has passed."""
        why = interruption.notice(node, self.cfg.interruption_taints)
        if why is None:
            return
        name = (node.get("metadata") or {}).get("name")
        rows = await tx.conn.fetch(
            "SELECT * FROM executor.kube_jobs WHERE state = ANY($1::text[]) AND placement @> $2::jsonb "
            "AND interrupted_at IS NULL ORDER BY job_id FOR UPDATE", list(ACTIVE), json.dumps([{"node": name}]))
        for row in rows:
            what = f"node {name} is being reclaimed ({why})"
            await tx.conn.execute(
                "UPDATE executor.kube_jobs SET interrupted_at = $2, interruption = $3, checkpoint_at_notice = "
                "last_checkpoint WHERE job_id = $1", row["job_id"], tx.now, what)
            if not JobSpec.model_validate_json(row["spec"]).checkpoint.supported:
                await self.notices.event(ref_of(row), "InterruptionNotice", f"{what}; the job cannot checkpoint: "
                                         "it runs until the node goes", tx.now, warning=True)
                continue
            deadline = rfc3339(tx.now + self.cfg.interruption_checkpoint_s)
            for pod in self.pods.job_pods(row):
                try:
                    await self.api.patch(POD, pod["metadata"]["name"], {"metadata": {"annotations": {
                        n.CHECKPOINT_REQUESTED_ANNOTATION: deadline}}}, namespace=row["namespace"])
                except Exception as exc:
                    if status_code(exc) != 404:  # a pod already gone with its node asks for nothing
                        raise
            await self.notices.event(ref_of(row), "InterruptionNotice", f"{what}: checkpoint requested before "
                                     f"{deadline}; the job is requeued from it", tx.now, warning=True)

    async def loop(self, runtime: ServiceRuntime) -> None:
        await self.pods.informer.synced.wait()
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("interruptions: tick failed; trying again")
            await asyncio.sleep(self.tick_s)

    async def tick(self) -> None:
        """Requeue the jobs under notice that wrote their checkpoint, or waited long enough for it."""
        async with self.seat.transaction() as tx:
            rows = await tx.conn.fetch(
                "SELECT * FROM executor.kube_jobs WHERE interrupted_at IS NOT NULL AND state = ANY($1::text[]) "
                "ORDER BY job_id FOR UPDATE", list(ACTIVE))
            for row in rows:
                why = interruption.requeue_now(
                    can_checkpoint=JobSpec.model_validate_json(row["spec"]).checkpoint.supported,
                    checkpoint_at_notice=row["checkpoint_at_notice"], last_checkpoint=row["last_checkpoint"],
                    noticed_at=row["interrupted_at"], now=tx.now, wait_s=self.cfg.interruption_checkpoint_s)
                if why is None:
                    continue
                # NodeFailure: the job's node goes and it resumes from its checkpoint (no new reason on the bus)
                await self.outcomes.requeue(tx, row, PreemptionReason.NODE_FAILURE, f"{row['interruption']}: {why}",
                                            count=False)
                await tx.conn.execute("UPDATE executor.kube_jobs SET interrupted_at = NULL, interruption = NULL, "
                                      "checkpoint_at_notice = NULL WHERE job_id = $1", row["job_id"])
