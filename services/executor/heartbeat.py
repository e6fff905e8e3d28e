"""The executors' heartbeat: one `ExecutorHeartbeat` per interval listing every job the executor runs.

One event per executor per interval, whatever the number of jobs, rather than one per job: liveness then costs
the bus a constant rate (issue budget: about 10 events per job in all), and a heartbeat proves what it should,
that the process that runs the jobs is alive and still has them. A long list is split into parts so that no
event nears NATS's payload limit.

A heartbeat is the executor's word that it runs these jobs and no others, and the scheduler fails a placed job that
heartbeats leave out for long enough (services/core/scheduler/liveness.py). So the executor speaks only when it is
connected and current (shared/catchup.py): not while its bus connection is down (a heartbeat written then would be
published late, listing what it ran long ago), and after each (re)connection, not before it has consumed the
placements that waited for it (a job placed during the outage is not in its tables yet).
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.catchup import BusCatchUp
from shared.events import ExecutorHeartbeat, utcnow_from
from shared.service import ServiceRuntime, Tx
from shared.settings import settings

MAX_JOBS_PER_EVENT = 4000  # ~40 bytes per id: well under NATS's 1 MiB default payload limit


def interval_from_env() -> float:
    return settings().heartbeat_interval_s


class Heartbeat:
    """Decides when the next heartbeat is due (on the executor's wall clock, passed in) and emits it."""

    def __init__(self, executor: str, interval_s: float | None = None):
        self.executor = executor
        self.interval_s = interval_s if interval_s is not None else interval_from_env()
        self._last: float | None = None
        self.bus = BusCatchUp(f"{executor} heartbeat")
        self.withheld = 0  # heartbeats due but not sent: the executor was not connected and current

    def due(self, wall: float) -> bool:
        return self._last is None or wall - self._last >= self.interval_s

    async def may_send(self, runtime: ServiceRuntime, wall: float) -> bool:
        """Due, and the executor is connected and caught up with the bus (asked before the unit of work: it may
        ask the server about the consumers)."""
        if not self.due(wall):
            return False
        if await self.bus.current(runtime):
            return True
        self.withheld += 1
        return False

    async def emit(self, tx: Tx, wall: float, running: Iterable[str],
                   chunk: int = MAX_JOBS_PER_EVENT) -> int:
        """Emit this interval's heartbeat (in `tx`: it is published only if the transaction commits); returns the
        number of events."""
        self._last = wall
        jobs = sorted(set(running))
        parts = [jobs[i:i + chunk] for i in range(0, len(jobs), chunk)] or [[]]
        for index, part in enumerate(parts):
            await tx.emit(ExecutorHeartbeat(executor=self.executor, running=tuple(part),
                                            sent_at=utcnow_from(tx.now), interval_s=self.interval_s,
                                            part=index, parts=len(parts)))
        return len(parts)


