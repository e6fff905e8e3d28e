"""Idle reclaim's victims (issue 48, docs/admission.md "Interactive work"): telemetry asks, with reason IdleReclaim and
the idle job as the only candidate, to checkpoint and requeue a job whose GPUs stayed idle past its class's warning
and grace (services/core/idle). The job is evicted through the usual checkpoint-before-preempt protocol unless a
promise forbids it: a job of a class that is never preempted (production, a non-preemptible class or spec) keeps
running, and a job already being preempted is not taken twice. No protection window: a job idle for its class's
`idle_for_s` and grace has had its window, and the request names it; an ended or unknown job is no victim."""

from __future__ import annotations

from collections.abc import Iterable

from .model import RunningJob, Why
from .policy import class_verdict


def idle_victims(candidates: Iterable[str], running: Iterable[RunningJob],
                 busy: Iterable[str] = ()) -> tuple[tuple[str, ...], dict[str, str]]:
    """(victims in job id order, candidate -> why kept) for an idle reclaim request."""
    by_id = {j.job_id: j for j in running}
    busy_set = set(busy)
    victims: list[str] = []
    kept: dict[str, str] = {}
    for job_id in sorted(set(candidates)):
        job = by_id.get(job_id)
        if job is None:
            kept[job_id] = "not running"
            continue
        verdict = class_verdict(job)
        if verdict is not None:
            kept[job_id] = verdict
        elif job_id in busy_set:
            kept[job_id] = Why.BEING_PREEMPTED
        else:
            victims.append(job_id)
    return tuple(victims), kept
