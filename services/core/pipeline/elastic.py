"""Elastic jobs in the decision loop: start at what fits, give pods back before anyone is preempted, grow into idle
GPUs in order of fair share (docs/scheduler.md, "Elastic jobs").

A job with a pod set of `min_count`..`count` pods (PodSet.min_count) is admitted for its floor. After the cycle's
admissions and placements, before the preemption stage (`ElasticPass.finish`):

0. *Give back.* A running elastic job gives back its pods above its floor while a job the configuration can admit
   still waits for admission in its own queue, and those holding quota above its queue's nominal while one waits
   elsewhere in its cohort; that cohort's reclaims wait for the next pass (`defers`), where the job is admitted on
   the quota given back (the simulator decides again in the same instant, as after preemptions). So a grown pod
   never keeps a job out nor makes a reclaim preempt anyone.
1. *Starts.* A job just placed with more pods than its floor keeps only the pods its queue's growth room holds
   (`growth_room`: its nominal quota, then what its cohort lends; only the nominal while its cohort waits for
   admission, nothing while its own queue does); those are charged (quota charges what runs).
2. *Shrink before preemption.* Each admitted job left unplaced for a reason a preemption could cure, in
   placement order, takes pods above the floors of running elastic jobs, whole jobs at a time from the queue
   furthest above its fair share (its GPUs in use over its nominal GPUs; then the lower priority, then the job
   id), until it fits; if it would not fit with every elastic job at its floor, nothing is shrunk (the
   preemption stage then decides). Pods above a floor are never guaranteed: any admitted job may take them.
3. *Grow.* Only when no admitted job is left waiting for capacity (a curable reason or a reservation) and no
   capacity is held for a preemptor, idle GPUs go one pod at a time to the running elastic job whose queue is
   furthest below its fair share (then the higher priority, then the job id), within its queue's growth room. So a
   grown pod never takes a GPU a waiting job could have used: growth stops whenever one waits, and what grew is
   the first thing taken back.

Deterministic and pure: sorted iteration, ties broken by id. The caller names the running elastic jobs.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.core.admission import (
    AdmissionState,
    above_floor,
    charge_running,
    cohort_waits,
    growth_room,
    over_nominal,
    queue_waits,
    quota_keys,
)
from services.core.scheduler import (
    ClusterIndex,
    CycleResult,
    Placement,
    Reason,
    can_grow,
    grow_one,
    place_now,
    restore,
    shrink_to,
)
from shared.domain import JobSpec
from shared.quota_keys import is_whole_gpu

from .pipeline import CURABLE, WaitingJob

GROW, SHRINK, START = "Grow", "Shrink", "Start"


@dataclass(frozen=True)
class Resize:
    """A running elastic job's new size: `pods` (it ran `pods_before`); why (`reason`); for a shrink, the waiting
    job it made room for (None: its own queue waits for admission, or its start was capped by quota)."""

    job_id: str
    pods_before: int
    pods: int
    reason: str
    for_job: str | None = None


def share(state: AdmissionState, queue: str) -> float:
    """A queue's fair-share standing: the whole GPUs its admitted jobs hold over its nominal whole GPUs."""
    qq = state.book.queues.get(queue)
    nominal = sum(n for r, n in qq.nominal.items() if is_whole_gpu(r)) if qq is not None else 0
    used = sum(n for r, n in state.usage(queue).items() if is_whole_gpu(r))
    return used / nominal if nominal else float("inf")


def _model(state: AdmissionState, spec: JobSpec) -> str | None:
    ps = next((p for p in spec.pod_sets if p.elastic), None)
    a = state.admitted.get(spec.job_id)
    return a.flavors.get(ps.name) if a is not None and ps is not None else None


class ElasticPass:
    """One pass's elastic steps (the module docstring) over the running elastic jobs `elastic` (by id, their
    specs), run after the cycle (`finish`)."""

    def __init__(self, state: AdmissionState, cluster: ClusterIndex, elastic: Mapping[str, JobSpec]) -> None:
        self.state, self.cluster, self.elastic = state, cluster, elastic
        self.before: dict[str, int] = {}
        self.why: dict[str, tuple[str, str | None]] = {}
        self.memo: dict[str, bool] = {}  # cohort -> a job waits for admission there (after this pass's admission)
        self.gave_back: set[str] = set()  # queues whose elastic jobs gave pods back

    def size(self, job_id: str) -> int:
        p = self.cluster.placement_of(job_id)
        return len(p.bindings) if p is not None else 0

    def set(self, spec: JobSpec, placement: Placement, pods: int, reason: str, for_job: str | None) -> Placement:
        now = len(placement.bindings)
        self.before.setdefault(spec.job_id, now)
        self.why[spec.job_id] = (reason, for_job)
        new = shrink_to(self.cluster, spec, placement, pods)
        charge_running(self.state, spec.job_id, now, len(new.bindings))
        return new

    def starts(self, result: CycleResult) -> None:
        for i, p in enumerate(result.placed):
            a = self.state.admitted.get(p.job_id)
            if a is None or not a.spec.elastic:
                continue
            spec, pods = a.spec, len(p.bindings)
            keys = quota_keys(self.state, spec.queue)
            room = {r: growth_room(self.state, spec.queue, r, self.memo)
                    for r in sorted({*a.flavors.values(), *keys})}
            while pods > spec.min_pods and any(n > room.get(r, 0) for r, n in above_floor(
                    spec, a.flavors, pods, keys).items()):
                pods -= 1
            new = shrink_to(self.cluster, spec, p, pods) if pods < len(p.bindings) else p
            result.placed[i] = new
            charge_running(self.state, spec.job_id, spec.min_pods, len(new.bindings))
            if len(new.bindings) < len(p.bindings):
                self.before[spec.job_id], self.why[spec.job_id] = len(p.bindings), (START, None)

    def above(self) -> list[tuple[str, JobSpec]]:
        return [(j, s) for j, s in sorted(self.elastic.items()) if self.size(j) > s.min_pods]

    def give_back(self) -> None:
        """All pods above the floor while a job of the queue waits for admission; those above the queue's nominal
        quota while a job of its cohort does."""
        for job_id, spec in self.above():
            p = self.cluster.placement_of(job_id)
            model = _model(self.state, spec)
            if p is None or model is None:
                continue
            if queue_waits(self.state, spec.queue, self.memo):
                pods = spec.min_pods
            elif cohort_waits(self.state, spec.queue, self.memo):
                over = over_nominal(self.state, spec.queue, model)
                per_pod = max(1, next(ps.gpus_per_pod for ps in spec.pod_sets if ps.elastic))
                pods = max(spec.min_pods, len(p.bindings) - -(-over // per_pod)) if over > 0 else len(p.bindings)
            else:
                continue
            if pods < len(p.bindings):
                self.set(spec, p, pods, SHRINK, None)
                self.gave_back.add(spec.queue)

    def defers(self, queue: str) -> bool:
        """Whether a reclaim for `queue` waits for the next pass: pods above a floor were given back in its cohort
        (its job may be admitted on that quota without preempting anyone)."""
        qq = self.state.book.queues.get(queue)
        if qq is None or not self.gave_back:
            return False
        return any(q == queue or (qq.cohort is not None and (o := self.state.book.queues.get(q)) is not None
                                  and o.cohort == qq.cohort) for q in self.gave_back)

    def make_room(self, result: CycleResult, waiting: Mapping[str, WaitingJob]) -> None:
        for u in list(result.unplaceable):
            w = waiting.get(u.job_id)
            if u.reason not in CURABLE or w is None:
                continue
            donors = sorted(self.above(), key=lambda js: (-share(self.state, js[1].queue),
                                                            self.state.priority(js[0]) or 0, js[0]))
            shrunk: list[tuple[Placement, JobSpec]] = []
            fixed = w.spec.at_pods(w.spec.min_pods)  # an elastic job placed this way starts at its floor
            got = place_now(self.cluster, fixed, w.allowed_models)  # a start capped by quota may have left room
            for job_id, spec in donors if got is None else ():
                p = self.cluster.placement_of(job_id)
                if p is None:
                    continue
                shrink_to(self.cluster, spec, p, spec.min_pods)
                shrunk.append((p, spec))
                got = place_now(self.cluster, fixed, w.allowed_models)
                if got is not None:
                    break
            if got is None:
                for old, _ in reversed(shrunk):
                    restore(self.cluster, old)
                continue
            for old, spec in shrunk:
                self.before.setdefault(spec.job_id, len(old.bindings))
                self.why[spec.job_id] = (SHRINK, u.job_id)
                charge_running(self.state, spec.job_id, len(old.bindings), self.size(spec.job_id))
            result.unplaceable.remove(u)
            result.reservations.pop(u.job_id, None)
            result.placed.append(got)

    def grow(self) -> None:
        heap = [(share(self.state, s.queue), -(self.state.priority(j) or 0), j) for j, s in
                sorted(self.elastic.items())]
        heapq.heapify(heap)
        failed: set[tuple[object, ...]] = set()
        while heap:
            _, prio, job_id = heapq.heappop(heap)
            spec = self.elastic[job_id]
            p = self.cluster.placement_of(job_id)
            ps = can_grow(spec, p) if p is not None else None
            model = _model(self.state, spec)
            a = self.state.admitted.get(job_id)
            if p is None or ps is None or model is None or a is None:
                continue
            key = (ps.model_copy(update={"name": "", "count": 1, "min_count": None}).model_dump_json(),
                   spec.tolerations, spec.topology, tuple(sorted(a.flavors.values())))
            if key in failed or not self.room_for_one(spec, a.flavors, len(p.bindings)):
                continue
            new = grow_one(self.cluster, spec, tuple(sorted(set(a.flavors.values()))), p)
            if new is None:
                failed.add(key)
                continue
            self.before.setdefault(job_id, len(p.bindings))
            self.why.setdefault(job_id, (GROW, None))
            charge_running(self.state, job_id, len(p.bindings), len(new.bindings))
            heapq.heappush(heap, (share(self.state, spec.queue), prio, job_id))

    def room_for_one(self, spec: JobSpec, flavors: dict[str, str], pods: int) -> bool:
        """Whether the queue's growth room holds one more pod: its GPUs and its part of the non-GPU quota keys."""
        keys = quota_keys(self.state, spec.queue)
        now = above_floor(spec, flavors, pods, keys)
        more = above_floor(spec, flavors, pods + 1, keys)
        return all(growth_room(self.state, spec.queue, r, self.memo) >= n - now.get(r, 0) for r, n in more.items()
                   if n > now.get(r, 0))

    def resizes(self) -> list[Resize]:
        out = []
        for job_id in sorted(self.before):
            pods = self.size(job_id)
            reason, for_job = self.why[job_id]
            before = self.before[job_id]
            if reason != START:  # a pass may shrink a job for a waiting one, then grow it into what is left
                reason = GROW if pods > before else SHRINK
            if pods != before or reason == START:
                out.append(Resize(job_id, before, pods, reason, for_job if reason == SHRINK else None))
        return out


    def finish(self, result: CycleResult, waiting: Mapping[str, WaitingJob], *, held: bool = False
               ) -> list[Resize]:
        """Steps 1-3 on the snapshot `cycle` left: `result` is brought up to date (jobs placed by shrinking others
        move from its unplaceable to its placed; a start capped by quota has its smaller placement), the
        placements are committed on the cluster and the quota charged. `waiting`: every admitted job not placed
        before this pass (by id); `held`: capacity is held for a preemptor (nothing grows). Returns the running
        jobs resized in the whole pass, by id."""
        self.give_back()
        self.starts(result)
        started = {p.job_id: a.spec for p in result.placed
                   if (a := self.state.admitted.get(p.job_id)) is not None and a.spec.elastic}
        self.elastic = {**self.elastic, **started}
        if not self.elastic:
            return self.resizes()
        self.make_room(result, waiting)
        blocked = any(u.reason in CURABLE or u.reason == Reason.WAITING_FOR_RESERVATION for u in result.unplaceable)
        if not blocked and not held:
            self.grow()
        return self.resizes()


def placed_sizes(placed: Sequence[Placement]) -> dict[str, int]:
    """Job -> pods placed (what a caller reports as each start's size)."""
    return {p.job_id: len(p.bindings) for p in placed}


__all__ = ["GROW", "SHRINK", "START", "ElasticPass", "Resize", "placed_sizes", "share"]
