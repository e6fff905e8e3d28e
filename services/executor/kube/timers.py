"""What the executor checks on a clock rather than on an event: the end of a backoff, an image that still cannot be
pulled, pods still unbound, the runtime limit, the PodsReady timeout; and the heartbeat that lists what runs."""

from __future__ import annotations

import asyncio
import json

import asyncpg

from services.core.kube.pods import ready_count, unschedulable
from services.executor.heartbeat import Heartbeat
from services.executor.kube.leadership import Seat
from services.executor.kube.outcomes import Outcomes
from services.executor.kube.pods import PodWatch
from services.executor.kube.records import ACTIVE
from services.executor.kube.running import Runner
from services.executor.kube.settings import KubeExecutorSettings
from shared.domain import JobSpec
from shared.events import ExitReason, PreemptionReason
from shared.service import ServiceRuntime, Tx


class Timers:
    def __init__(self, settings: KubeExecutorSettings, seat: Seat, heartbeat: Heartbeat, outcomes: Outcomes,
                 pods: PodWatch, runner: Runner):
        self.settings = settings
        self.cfg = settings.kube
        self.seat = seat
        self.heartbeat = heartbeat
        self.outcomes = outcomes
        self.pods = pods
        self.runner = runner

    async def timer_loop(self, runtime: ServiceRuntime) -> None:
        self.heartbeat.bus.forget()  # (re)started: heartbeats wait until the executor is caught up with the bus
        while True:
            await self.tick()
            await asyncio.sleep(self.settings.tick_s)

    async def tick(self) -> None:
        """PodsReady timeout, runtime limit, image pull deadline, end of backoff."""
        wall = asyncio.get_running_loop().time()
        # Only while connected and current with the bus, and with Kubernetes: the pods listed once at least.
        beat = self.pods.informer.synced.is_set() and await self.heartbeat.may_send(self.seat.rt(), wall)
        async with self.seat.transaction() as tx:
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
                await self.runner.run(tx, row["job_id"])
            return
        if row["pull_problem_at"] is not None and now - row["pull_problem_at"] >= cfg.image_pull_timeout_s:
            problem = json.loads(row["failure"])["message"] if row["failure"] else "image cannot be pulled"
            await self.outcomes.fail(tx, row, ExitReason.IMAGE_PULL,
                                     f"{problem} (still failing after {cfg.image_pull_timeout_s:g} s)")
            return
        if row["unbound_at"] is not None and now - row["unbound_at"] >= cfg.bind_timeout_s:
            stuck = [(p, "Unschedulable", why) for p in self.pods.attempt_pods(row) if (why := unschedulable(p))]
            await self.pods.placement_failed(tx, row, stuck, f"{row['unbound_message']} (for {cfg.bind_timeout_s:g} s)")
            return
        spec = JobSpec.model_validate_json(row["spec"])
        if row["state"] == "running" and now - row["started_at"] >= spec.max_runtime_s:
            await self.outcomes.fail(tx, row, ExitReason.DEADLINE_EXCEEDED,
                                     f"ran past max_runtime_s={spec.max_runtime_s}")
            return
        if row["state"] == "placed" and now - row["placed_at"] >= cfg.pods_ready_timeout_s:
            ready = ready_count(self.pods.job_pods(row))
            await self.outcomes.requeue(
                tx, row, PreemptionReason.PODS_READY_TIMEOUT,
                f"{ready} of {spec.gang_size} pod(s) Ready after {cfg.pods_ready_timeout_s:g} s")
