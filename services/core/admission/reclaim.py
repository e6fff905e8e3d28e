"""Reclaim: a queue under its nominal quota whose pending job does not fit because others borrowed names the
borrowers' jobs that could give the quota back (PreemptionRequested with reason `ReclaimQuota`).

Candidates (Kueue preemption/common/ordering.go, restricted to reclaim): admitted jobs of the *other* queues of the
cohort tree (Kueue: the root's SubtreeClusterQueues) that are above their nominal quota on a resource the preemptor
needs, that use that resource and are preemptible; under `reclaim_within_cohort: LowerPriority` only jobs of
strictly lower priority than the preemptor, under `Any` every such job. Ordered lowest priority first, then the
jobs that checkpoint (a reclaim costs them their checkpoint write, issue 49), then most recently admitted first
(least work lost), then job id. The preemption service chooses the minimal set among them
(protection windows, checkpoints); listing them all keeps that choice in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.core.admission.quota import QueueQuota
from shared.config import PreemptionPolicy

if TYPE_CHECKING:
    from services.core.admission.state import AdmissionState


def reclaim_candidates(state: AdmissionState, qq: QueueQuota, priority: int,
                       need: Mapping[str, int]) -> tuple[str, ...]:
    if qq.cohort is None or qq.reclaim_policy is PreemptionPolicy.NEVER:
        return ()
    book = state.book
    lower_only = qq.reclaim_policy is PreemptionPolicy.LOWER_PRIORITY
    ckpt_first = state.config.policy.loss_aware_reclaim  # checkpointing candidates first (issue 49), when on
    found: list[tuple[int, bool, float, str]] = []
    for other in book.pool_members.get(qq.pool, ()) if qq.pool is not None else ():  # the whole cohort tree
        if other == qq.name:
            continue
        over = [r for r in sorted(need) if book.used(other, r) > book.nominal(other, r)]
        if not over:
            continue
        for e in state.admitted_entries(other):
            a = e.admitted
            if a is None or not e.preemptible or (lower_only and e.priority >= priority):
                continue
            if any(a.usage.get(r, 0) > 0 for r in over):
                found.append((e.priority, ckpt_first and e.unsaved_runtime_s > 0, -a.admitted_at, e.job_id))
    found.sort()
    return tuple(job_id for _p, _u, _t, job_id in found)
