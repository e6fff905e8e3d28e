"""Job liveness: which placed jobs are lost (pure; the scheduler's liveness watch applies the verdicts).

A placed job is lost when its executor, heard and current, has not listed it in its heartbeats for longer than
`heartbeat_timeout_s`, or when it has run past its runtime limit plus `runtime_grace_s` (the executor should have
failed it at the limit itself; a job still placed after the grace was missed).

Silence alone is no verdict. An executor that is not heard at all (it is down, or it cannot reach the bus, or the
scheduler cannot) says nothing about its jobs: their pods run on without it, and a standby executor takes over and
lists them. A job is lost for silence only on the executor's word: a complete heartbeat, sent after the job was
placed (`ExecutorRound.sent_at`), received more than the timeout after the last heartbeat that listed the job. The
executor sends heartbeats only while it is connected and caught up with the bus (services/executor/heartbeat.py), so
a heartbeat that leaves a job out means that the executor, current, does not run it.

Two clocks, both passed in: heartbeats are measured on the watch's own monotonic clock (how long the scheduler has
heard nothing is about processes, not about the jobs' simulated or real time), the placement, the runtime limit and
a heartbeat's sending on the services' clock.
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
class ExecutorRound:
    """The executor's latest complete heartbeat (every part of it received)."""

    executor: str
    heard_at: float  # watch clock: when its last part was received
    sent_at: float  # services' clock: when the executor sent it


@dataclass(frozen=True)
class Lost:
    job_id: str
    message: str


def lost_jobs(jobs: Iterable[WatchedJob], *, now: float, heard_now: float, settings: LivenessSettings,
              latest: ExecutorRound | None = None) -> list[Lost]:
    """The lost jobs among `jobs`, by job id. `now` is the services' clock, `heard_now` the watch clock; `latest` the
    executor's latest complete heartbeat (None: none heard since the watch started or caught up with the bus)."""
    out: list[Lost] = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        overrun = now - job.placed_at - job.max_runtime_s
        if latest is not None and _left_out(job, latest, settings):
            silent = heard_now - job.last_heard
            out.append(Lost(job.job_id, f"no executor heartbeat listed the job for {silent:.0f} s (timeout "
                                        f"{settings.heartbeat_timeout_s:g} s), while {latest.executor} reported "
                                        f"{heard_now - latest.heard_at:.0f} s ago without it"))
        elif overrun > settings.runtime_grace_s:
            out.append(Lost(job.job_id, f"still placed {overrun:.0f} s past max_runtime_s={job.max_runtime_s:g} "
                                        f"(grace {settings.runtime_grace_s:g} s)"))
    return out


def _left_out(job: WatchedJob, latest: ExecutorRound, settings: LivenessSettings) -> bool:
    """Has the executor said, current, that it does not run the job: a heartbeat sent after the placement, heard
    more than the timeout after the last one that listed the job (the latest does not list it, or it would be the
    last one that listed it)?"""
    return latest.sent_at >= job.placed_at and latest.heard_at - job.last_heard > settings.heartbeat_timeout_s
