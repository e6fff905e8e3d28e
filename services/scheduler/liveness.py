"""The scheduler's liveness watch: executor heartbeats in, `JobFailed(Lost)` out for placed jobs nobody runs.

The scheduler owns placements, so it is the one to say a placement is dead, and it says so only on the executor's
word (services/core/scheduler/liveness.py): a job is lost for silence when the executor, heard and current, has left
it out of its heartbeats for longer than the timeout; an executor not heard at all condemns nothing.

The watch acts only while it hears the bus itself (shared/catchup.py): while the scheduler's NATS connection is down,
and after each reconnection until its consumers have handled the backlog (and `GPUQ_LIVENESS_GRACE_S` has passed),
it declares nothing; then it counts every placed job as heard at that moment, so that the heartbeats its own outage
kept from it are not held against any job. Heartbeats are kept in memory only: a scheduler that starts (or takes
the lease over) does the same, so a restart can delay a verdict by one timeout but never cause one.

The verdict is one `JobFailed` with exit reason `Lost` through the outbox, in a transaction that checks the
scheduler's fence; the scheduler, admission and the executor then release GPUs, quota and the run on their ordinary
`JobFailed` path, each once (their handlers are keyed by the job's status). A job already declared is not declared
again while its `JobFailed` is on its way.

Settings: `GPUQ_HEARTBEAT_TIMEOUT_S` (default 120 s of the scheduler's wall clock), `GPUQ_RUNTIME_GRACE_S`
(default 900 s past `max_runtime_s`, services' clock), `GPUQ_LIVENESS_CHECK_S` (how often it looks, default 5 s),
`GPUQ_LIVENESS_GRACE_S` (after the scheduler's own (re)connection to the bus, how long it waits at least before
judging, besides consuming the backlog; default 10 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.core.scheduler.liveness import ExecutorRound, LivenessSettings, WatchedJob, lost_jobs
from shared.catchup import BusCatchUp
from shared.events import CloudEvent, ExecutorHeartbeat, ExitReason, JobFailed, utcnow_from
from shared.service import ServiceRuntime, Tx
from shared.settings import settings as read_settings

log = logging.getLogger("gpuq.scheduler.liveness")


@dataclass
class LivenessWatch:
    settings: LivenessSettings = field(default_factory=LivenessSettings)
    check_s: float = 5.0
    monotonic: Callable[[], float] = time.monotonic  # injected: the watch clock
    grace_s: float = 10.0  # after the scheduler's own (re)connection, at least this long before judging
    heard: dict[str, float] = field(default_factory=dict)  # job -> last heartbeat that listed it (watch clock)
    rounds: dict[str, ExecutorRound] = field(default_factory=dict)  # executor -> its latest complete heartbeat
    declared: set[str] = field(default_factory=set)  # JobFailed(Lost) emitted, not yet back as finished
    lost_total: int = 0
    paused: bool = True  # not judging: the bus is not heard, or its backlog not yet consumed
    bus: BusCatchUp | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LivenessWatch:
        given = read_settings(env)
        settings = LivenessSettings(heartbeat_timeout_s=given.heartbeat_timeout_s,
                                    runtime_grace_s=given.runtime_grace_s)
        return cls(settings=settings, check_s=given.liveness_check_s, grace_s=given.liveness_grace_s)

    def __post_init__(self) -> None:
        if self.grace_s < 0:
            raise ValueError(f"GPUQ_LIVENESS_GRACE_S must not be negative, not {self.grace_s}")
        if self.bus is None:
            self.bus = BusCatchUp("scheduler liveness", grace_s=self.grace_s, monotonic=self.monotonic)

    def reset(self) -> None:
        """At start and after a lease is taken again: every placed job counts as heard now, and nothing is judged
        until the scheduler is caught up with the bus."""
        self.heard.clear()
        self.rounds.clear()
        self.declared.clear()
        self.paused = True
        assert self.bus is not None
        self.bus.forget()

    async def on_heartbeat(self, tx: Tx, event: CloudEvent, payload: ExecutorHeartbeat) -> None:
        at = self.monotonic()
        for job_id in payload.running:
            self.heard[job_id] = at
        if payload.part == payload.parts - 1:  # the last part: the parts come in order, in one outbox write
            self.rounds[payload.executor] = ExecutorRound(payload.executor, at, payload.sent_at.timestamp())

    async def loop(self, runtime: ServiceRuntime) -> None:
        self.reset()  # background loops start after each (re)acquisition of the lease
        while True:
            await asyncio.sleep(self.check_s)
            await self.check(runtime)

    async def judging(self, runtime: ServiceRuntime) -> bool:
        """Whether the watch may judge now: the scheduler hears the bus and has consumed what waited for it. On
        coming back, every placed job counts as heard at that moment (the silence was the scheduler's own)."""
        assert self.bus is not None
        if not await self.bus.current(runtime):
            if not self.paused:
                log.warning("liveness paused: the scheduler does not hear the bus, or has not caught up with it; "
                            "no job is judged meanwhile")
            self.paused = True
            return False
        if self.paused:
            self.paused = False
            self.heard.clear()
            self.rounds.clear()
            log.info("liveness resumed: caught up with the bus; every placed job counts as heard now")
        return True

    async def check(self, runtime: ServiceRuntime) -> list[str]:
        """Declare the lost jobs; returns their ids."""
        if not await self.judging(runtime):
            return []
        async with runtime.transaction() as tx:
            rows = await tx.conn.fetch(
                "SELECT job_id, placed_at, (spec->>'max_runtime_s')::double precision AS max_runtime_s "
                "FROM scheduler.jobs WHERE status = 'placed' ORDER BY job_id")
            heard_now = self.monotonic()
            placed = {r["job_id"] for r in rows}
            for job_id in list(self.heard):
                if job_id not in placed:
                    del self.heard[job_id]
            self.declared &= placed
            watched = [WatchedJob(job_id=r["job_id"], placed_at=float(r["placed_at"] or tx.now),
                                  max_runtime_s=float(r["max_runtime_s"] or 0.0),
                                  last_heard=self.heard.setdefault(r["job_id"], heard_now))
                       for r in rows if r["job_id"] not in self.declared]
            latest = max(self.rounds.values(), key=lambda r: r.heard_at, default=None)
            verdicts = lost_jobs(watched, now=tx.now, heard_now=heard_now, settings=self.settings, latest=latest)
            if not verdicts:
                return []
            if runtime.lease is not None:
                await runtime.lease.check_fence(tx.conn)  # a deposed leader declares nothing
            for verdict in verdicts:
                log.warning("job %s is lost: %s", verdict.job_id, verdict.message)
                await tx.emit(JobFailed(job_id=verdict.job_id, exit_reason=ExitReason.LOST, message=verdict.message,
                                        finished_at=utcnow_from(tx.now)))
        self.declared.update(v.job_id for v in verdicts)
        self.lost_total += len(verdicts)
        return [v.job_id for v in verdicts]
