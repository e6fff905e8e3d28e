"""Job liveness: which placed jobs are lost (pure; the scheduler's liveness watch applies the verdicts).

A placed job is lost when no executor heartbeat has listed it for `heartbeat_timeout_s`, or when it has run past
its runtime limit plus `runtime_grace_s` (the executor should have failed it at the limit itself; a job still
placed after the grace was missed). Two clocks, both passed in: heartbeats are measured on the watch's own
monotonic clock (how long the scheduler has heard nothing is about processes, not about the jobs' simulated or
real time), the runtime limit on the services' clock that placed the job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LivenessSettings:
    heartbeat_timeout_s: float = 120.0
    runtime_grace_s: float = 900.0

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, not {self.heartbeat_timeout_s}")
        if self.runtime_grace_s < 0:
            raise ValueError(f"runtime_grace_s must not be negative, not {self.runtime_grace_s}")


@dataclass(frozen=True)
class WatchedJob:
    job_id: str
    placed_at: float  # services' clock
    max_runtime_s: float
    last_heard: float  # watch clock: the last heartbeat that listed it, or when the watch first saw it placed


@dataclass(frozen=True)
class Lost:
    job_id: str
    message: str


def lost_jobs(jobs: Iterable[WatchedJob], *, now: float, heard_now: float, settings: LivenessSettings) -> list[Lost]:
    """The lost jobs among `jobs`, by job id. `now` is the services' clock, `heard_now` the watch clock."""
    out: list[Lost] = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        silent = heard_now - job.last_heard
        overrun = now - job.placed_at - job.max_runtime_s
        if silent > settings.heartbeat_timeout_s:
            out.append(Lost(job.job_id, f"no executor heartbeat listed the job for {silent:.0f} s "
                                        f"(timeout {settings.heartbeat_timeout_s:g} s)"))
        elif overrun > settings.runtime_grace_s:
            out.append(Lost(job.job_id, f"still placed {overrun:.0f} s past max_runtime_s={job.max_runtime_s:g} "
                                        f"(grace {settings.runtime_grace_s:g} s)"))
    return out
