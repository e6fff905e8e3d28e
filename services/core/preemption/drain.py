"""Draining a queue (stop_policy HoldAndDrain, Kueue's ClusterQueue stopPolicy): which of its running jobs are
evicted now, which are kept and why, and when to look again.

Kueue evicts every admitted workload of a HoldAndDrain queue. gpuq keeps two promises above that: a job of a class
that is never preempted (production, or a non-preemptible class or spec) keeps running, and a job inside its
protection window (just started, or about to end) is drained only when the window ends. Everything else is
evicted through the usual checkpoint-before-preempt protocol. Drains are not charged to the queue's
max_preemptions_per_hour (that limit caps what a queue's jobs take from others; a drain is an admin's decision).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .model import RunningJob, Why
from .policy import class_verdict, protection


@dataclass(frozen=True)
class DrainPlan:
    victims: tuple[str, ...]  # evict now, in job id order
    kept: dict[str, str] = field(default_factory=dict)  # running job of the queue -> why it is not evicted now
    retry_at: float | None = None  # when the first protected job leaves its window (None: nothing to wait for)


def drain_plan(queue: str, running: Iterable[RunningJob], now: float, protection_window_s: int,
               busy: Iterable[str] = ()) -> DrainPlan:
    """The drain of `queue` at `now`: its running jobs, minus those never preempted, those already being
    preempted (`busy`) and those inside their protection window (retried when the first window ends)."""
    busy_set = set(busy)
    victims: list[str] = []
    kept: dict[str, str] = {}
    retry: list[float] = []
    for job in sorted((j for j in running if j.queue == queue), key=lambda j: j.job_id):
        verdict = class_verdict(job)
        if verdict is not None:
            kept[job.job_id] = verdict
            continue
        if job.job_id in busy_set:
            kept[job.job_id] = Why.BEING_PREEMPTED
            continue
        protected = protection(job, now, protection_window_s)
        if protected is not None:
            kept[job.job_id] = protected[0]
            retry.append(protected[1])
            continue
        victims.append(job.job_id)
    return DrainPlan(tuple(victims), kept, min(retry) if retry else None)
