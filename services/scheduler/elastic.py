"""Running elastic jobs resized by the scheduler service (issue 48; docs/scheduler.md, "Elastic jobs").

The scheduler owns placement, admission owns the quota charge, the executor the workload. So a resize is a
conversation of three events, each fact written by its owner in one transaction with the event that tells it:

- **Grow.** When a cycle leaves no admitted job waiting for capacity and holds nothing for a preemptor, the
  running elastic job of the queue furthest below its fair share (its whole GPUs placed over its nominal whole
  GPUs; then the higher priority, then the job id) one more pod of which fits now is named to admission:
  `JobGrowRequested` (one at a time in the whole cluster, the asked size kept in `scheduler.jobs.grow_requested`).
  Admission charges the pod if the queue's growth room holds it and answers `JobResizeAdmitted` (granted or not).
  The scheduler then places what still fits, up to the size granted, and says so in `JobResized` (always, even when
  nothing fitted any more: admission charges exactly the pods it names).
- **Shrink before preemption.** An admitted job left unplaced for a reason a preemption could cure takes the pods
  above the floors of running elastic jobs (whole jobs at a time, the queue furthest above its fair share first,
  then the lower priority, then the id) when that makes it fit: the donors are shrunk and the job placed in the
  same cycle, before it may ask for preemption, and each donor's `JobResized` names it. When not even every
  elastic job at its floor would make room, nothing is shrunk.
- **Give back.** Admission asks for pods back (`JobResizeAdmitted` below the placed size) while a job waits for
  admission; the scheduler shrinks the job and says so in `JobResized`, on which admission releases the charge.

Pure bookkeeping over the placement core (services/core/scheduler/elastic.py); the service writes rows and events.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from services.core.pipeline import WaitingJob
from services.core.pipeline.pipeline import CURABLE
from services.core.scheduler import ClusterIndex, CycleResult, Placement, Reason, can_grow, grow_one, place_now, restore
from services.core.scheduler import shrink_to as core_shrink_to
from services.scheduler import held
from shared import audit
from shared.audit import service_actor
from shared.config import QueuesConfig
from shared.events import JobGrowRequested, JobResizeAdmitted, JobResized
from shared.quota_keys import is_whole_gpu
from shared.service import Tx

GROW, SHRINK = "Grow", "Shrink"


@dataclass(frozen=True)
class Donation:
    """A running elastic job shrunk so that `for_job` is placed: it ran `before`, it runs `after`."""

    job_id: str
    before: Placement
    after: Placement
    for_job: str


class ElasticJobs:
    """The placed jobs' queues (fair share) and the placed elastic jobs (their spec, allowed models and priority),
    the grow asked of admission and the grows it refused, kept in memory by the service."""

    def __init__(self) -> None:
        self.queue_of: dict[str, str] = {}  # placed job -> its queue
        self.jobs: dict[str, WaitingJob] = {}  # placed elastic job -> what placed it
        self.asked: dict[str, int] = {}  # job -> the pods asked of admission (at most one at a time)
        self.refused: set[str] = set()  # grows admission refused since quota last changed (a job ended)

    def clear(self) -> None:
        self.queue_of.clear()
        self.jobs.clear()
        self.asked.clear()
        self.refused.clear()

    def placed(self, job: WaitingJob) -> None:
        self.queue_of[job.spec.job_id] = job.spec.queue
        if job.spec.elastic:
            self.jobs[job.spec.job_id] = job

    def forget(self, job_id: str) -> None:
        self.queue_of.pop(job_id, None)
        self.jobs.pop(job_id, None)
        self.asked.pop(job_id, None)
        self.refused.clear()  # a job ended: quota may have freed for a grow refused before

    def shares(self, cluster: ClusterIndex, queues: QueuesConfig | None) -> dict[str, float]:
        """Each queue's standing: the GPUs its placed jobs hold over its nominal whole GPUs (inf without any)."""
        used: dict[str, int] = {}
        for job_id, queue in self.queue_of.items():
            p = cluster.placement_of(job_id)
            used[queue] = used.get(queue, 0) + (p.gpus if p is not None else 0)
        out: dict[str, float] = {}
        for q in queues.queues if queues is not None else ():
            nominal = sum(f.nominal for r, f in q.quotas.items() if is_whole_gpu(r))
            if nominal:
                out[q.name] = used.get(q.name, 0) / nominal
        return out

    def grow_candidate(self, cluster: ClusterIndex, queues: QueuesConfig | None) -> tuple[str, int] | None:
        """The job to grow by one pod and its size now, or None: nothing asked already, in fair-share order the
        first job one more pod of which fits now (tried on the cluster and undone)."""
        if self.asked:
            return None
        shares = self.shares(cluster, queues)
        order = sorted(self.jobs.items(), key=lambda kv: (shares.get(kv[1].spec.queue, float("inf")),
                                                            -kv[1].priority, kv[0]))
        for job_id, job in order:
            p = cluster.placement_of(job_id)
            if job_id in self.refused or p is None or can_grow(job.spec, p) is None:
                continue
            new = grow_one(cluster, job.spec, job.allowed_models, p)
            if new is not None:
                restore(cluster, p)
                return job_id, len(p.bindings)
        return None

    def grow_to(self, cluster: ClusterIndex, job_id: str, pods: int) -> tuple[Placement, Placement] | None:
        """Grow a placed elastic job toward `pods` with what fits now (committed): (before, after); None when it
        is not placed here."""
        job, p = self.jobs.get(job_id), cluster.placement_of(job_id)
        if job is None or p is None:
            return None
        now = p
        while len(now.bindings) < pods:
            more = grow_one(cluster, job.spec, job.allowed_models, now)
            if more is None:
                break
            now = more
        return p, now

    def shrink_to(self, cluster: ClusterIndex, job_id: str, pods: int) -> tuple[Placement, Placement] | None:
        job, p = self.jobs.get(job_id), cluster.placement_of(job_id)
        if job is None or p is None:
            return None
        return p, core_shrink_to(cluster, job.spec, p, pods)

    def make_room(self, cluster: ClusterIndex, queues: QueuesConfig | None, result: CycleResult,
                  waiting: Mapping[str, WaitingJob]) -> list[Donation]:
        """Shrink before preemption (the module docstring): the jobs so placed move from `result.unplaceable` to
        `result.placed` (at their floor, as the cycle starts an elastic job); returns the donors shrunk."""
        out: list[Donation] = []
        shares: dict[str, float] | None = None
        for u in list(result.unplaceable):
            w = waiting.get(u.job_id)
            if u.reason not in CURABLE or w is None or not self.jobs:
                continue
            shares = standing = self.shares(cluster, queues) if shares is None else shares
            donors = sorted(((j, job) for j, job in self.jobs.items()
                             if (p := cluster.placement_of(j)) is not None and len(p.bindings) > job.spec.min_pods),
                            key=lambda kv: (-standing.get(kv[1].spec.queue, float("inf")), kv[1].priority, kv[0]))
            if not donors:
                continue
            fixed = w.spec.at_pods(w.spec.min_pods) if w.spec.elastic else w.spec
            shrunk: list[tuple[str, Placement]] = []
            got = None
            for job_id, job in donors:
                p = cluster.placement_of(job_id)
                assert p is not None
                core_shrink_to(cluster, job.spec, p, job.spec.min_pods)
                shrunk.append((job_id, p))
                got = place_now(cluster, fixed, w.allowed_models)
                if got is not None:
                    break
            if got is None:
                for _, old in reversed(shrunk):
                    restore(cluster, old)
                continue
            for job_id, old in shrunk:
                now = cluster.placement_of(job_id)
                assert now is not None
                out.append(Donation(job_id, old, now, u.job_id))
            shares = None  # the standings moved
            result.unplaceable.remove(u)
            result.reservations.pop(u.job_id, None)
            result.placed.append(got)
        return out


async def ask_grow(tx: Tx, jobs: ElasticJobs, cluster: ClusterIndex, queues: QueuesConfig | None) -> None:
    """Ask admission to charge one more pod of the running elastic job furthest below its fair share that fits now
    (none while a grow is asked): the ask kept in the job's row, the event in this transaction."""
    found = jobs.grow_candidate(cluster, queues)
    if found is None:
        return
    job_id, pods = found
    jobs.asked[job_id] = pods + 1
    await tx.conn.execute("UPDATE scheduler.jobs SET grow_requested = $2 WHERE job_id = $1", job_id, pods + 1)
    await tx.emit(JobGrowRequested(job_id=job_id, pods_before=pods, pods=pods + 1))


async def answered(tx: Tx, jobs: ElasticJobs, cluster: ClusterIndex, payload: JobResizeAdmitted,
                   fence: Callable[[Tx], Awaitable[int | None]]) -> None:
    """Admission's word on a placed elastic job's size: a grow granted is placed with what still fits, a give-back
    shrinks it; either way JobResized says what it runs now (admission charges exactly that). A grow refused is not
    asked again until a job ends."""
    job_id = payload.job_id
    asked = jobs.asked.pop(job_id, None)
    p = cluster.placement_of(job_id)
    if job_id not in jobs.jobs or p is None:
        return  # ended meanwhile: its end releases its charge
    await held.write_held(tx)
    await tx.conn.execute("UPDATE scheduler.jobs SET grow_requested = NULL WHERE job_id = $1", job_id)
    if not payload.granted:
        jobs.refused.add(job_id)
    if payload.pods < len(p.bindings):
        moved, reason = jobs.shrink_to(cluster, job_id, payload.pods), SHRINK
    elif payload.granted and asked is not None:
        moved, reason = jobs.grow_to(cluster, job_id, payload.pods), GROW
    else:
        return
    if moved is not None:
        await resized(tx, jobs, moved[0], moved[1], reason, None, await fence(tx))


async def forget(tx: Tx, jobs: ElasticJobs, job_id: str) -> None:
    """The job ended: a grow it asked for is dropped from its row too (admission answers none for an ended job)."""
    if job_id in jobs.asked:
        await tx.conn.execute("UPDATE scheduler.jobs SET grow_requested = NULL WHERE job_id = $1", job_id)
    jobs.forget(job_id)


async def donated(tx: Tx, jobs: ElasticJobs, donations: list[Donation], term: int | None) -> None:
    for d in donations:
        await resized(tx, jobs, d.before, d.after, SHRINK, d.for_job, term)


async def resized(tx: Tx, jobs: ElasticJobs, before: Placement, after: Placement, reason: str,
                  for_job: str | None, term: int | None) -> None:
    """A placed elastic job's new placement: its row, an audit record and JobResized in this transaction."""
    job = jobs.jobs[after.job_id]
    await held.write_held(tx)
    await tx.conn.execute(
        "UPDATE scheduler.jobs SET bindings = $2::jsonb, racks_spanned = $3, blocks_spanned = $4, "
        "grow_requested = NULL WHERE job_id = $1", after.job_id,
        json.dumps([b.model_dump(mode="json") for b in after.bindings]), after.racks_spanned, after.blocks_spanned)
    await audit.record(tx, "resize", service_actor("scheduler"), job_id=after.job_id, team=job.spec.team,
                       pods_before=len(before.bindings), pods=len(after.bindings), reason=reason, for_job=for_job)
    await tx.emit(JobResized(job_id=after.job_id, spec=job.spec, bindings=after.bindings,
                             pods_before=len(before.bindings), pods=len(after.bindings), reason=reason,
                             for_job=for_job, fencing_token=term))


def blocked(result: CycleResult) -> bool:
    """Whether an admitted job is left waiting for capacity (nothing grows then)."""
    return any(u.reason in CURABLE or u.reason == Reason.WAITING_FOR_RESERVATION for u in result.unplaceable)


__all__ = ["GROW", "SHRINK", "Donation", "ElasticJobs", "answered", "ask_grow", "blocked", "donated", "forget",
           "resized"]
