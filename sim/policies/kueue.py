"""`kueue`: Kueue's default behaviour with the preemption setup its own docs recommend, then the default scheduler.

Semantics, with their source (Kueue v0.9+ docs "Cluster Queue" and "Preemption", pkg/scheduler/preemption):
* queueing strategy **BestEffortFIFO** (the ClusterQueue default): per queue, workloads in (priority, creation
  time) order; a workload that does not fit its quota does not block the ones behind it.
* **quota-level gangs**: a workload is admitted whole against its ClusterQueue's quota (nominal, then borrowing
  from the cohort's unused lendable quota within `borrowingLimit`), flavors tried in order, preferring a flavor
  that needs no borrowing. Physical placement is not checked at admission.
* preemption `withinClusterQueue: LowerPriority` and `reclaimWithinCohort: Any`: when the queue's first pending
  workload does not fit, victims are looked for among workloads of *other* queues of the cohort that borrow (any
  priority; only while the preemptor fits within its queue's nominal quota, since `borrowWithinCohort` is off
  by default) and among its own queue's lower-priority workloads. Candidates are ordered as Kueue does: other
  queues first, then lower priority, then most recently admitted; taken greedily (a borrower only while its
  queue still borrows) until the preemptor fits, then minimised in reverse. Victims are **evicted** (no
  checkpoint request; they lose the work since their last periodic checkpoint) and requeued with their
  creation time; the preemptor is admitted at once on the quota they freed.
* the admitted workload's pods go to the **default scheduler**: pod-by-pod first fit, no gang, no backfill.
"""

from __future__ import annotations

from bisect import insort

from sim.engine import CycleOutput, Preempted
from sim.failures import lost_work_s
from sim.model import Trace, TraceJob
from sim.policies.baselines import QuotaFifo, _Gang, _QueueState, _restrict

Entry = tuple[int, int, str]  # (-priority, submit time, job id): a queue's order


class Kueue(QuotaFifo):
    name = "kueue"

    def setup(self, trace: Trace) -> None:
        super().setup(trace)
        self.original: dict[str, TraceJob] = {}  # job -> the job as submitted (any-of models, before admission)
        self.admitted_at: dict[str, float] = {}
        self.members: dict[str, set[str]] = {name: set() for name in self.queues}  # queue -> admitted jobs
        self.run_start: dict[str, float] = {}  # running job -> start of its current run
        self._evicted: list[Preempted] = []

    # -- queue entries: each queue's `heap` is kept as a sorted list (a sorted list is also a valid heap, so
    #    QuotaFifo's helpers still read it), because BestEffortFIFO looks past a head that does not fit.
    def _enqueue(self, gang: _Gang, now: float) -> str | None:
        q = self._queue_for(gang)
        if isinstance(q, str):
            return q
        self.gangs[gang.job.job_id] = gang
        self.original[gang.job.job_id] = gang.job
        insort(q.heap, self._entry(gang.job))
        return None

    def _entry(self, job: TraceJob) -> Entry:
        return (-self.prio.get(job.priority_class, 0), job.submit_time, job.job_id)

    def on_completion(self, job_id: str, now: float) -> None:
        super().on_completion(job_id, now)
        self.members[self.original[job_id].queue].discard(job_id)
        self.original.pop(job_id, None)
        self.admitted_at.pop(job_id, None)
        self.run_start.pop(job_id, None)

    def cycle(self, now: float) -> CycleOutput:
        self._evicted = []
        self._admit(now)
        started = self._place_pods()
        for job_id in started:
            self.run_start[job_id] = now
        return CycleOutput(started=started, preempted=self._evicted)

    # -- admission
    def _admit(self, now: float) -> None:
        # Within a cycle usage only grows, so a workload that did not fit stays unfit: each queue keeps a cursor
        # to its first workload that fits, and moves it only forward.
        cursor = dict.fromkeys(self.queues, 0)
        failed: dict[str, set[tuple[tuple[str, ...], int]]] = {name: set() for name in self.queues}
        while True:
            best: tuple[Entry, str, int, tuple[str, int]] | None = None
            for name in sorted(self.queues):
                q = self.queues[name]
                found = self._first_fit(q, cursor[name], failed[name])
                if found is None:
                    cursor[name] = len(q.heap)
                    continue
                i, flavor = found
                cursor[name] = i
                if best is None or q.heap[i] < best[0]:
                    best = (q.heap[i], name, i, flavor)
            if best is None:
                break
            _, name, i, flavor = best
            self._admit_one(self.queues[name], i, flavor, now)
        for name in sorted(self.queues):
            q = self.queues[name]
            if q.heap:
                self._preempt_for(q, now)

    def _first_fit(self, q: _QueueState, start: int, failed: set[tuple[tuple[str, ...], int]]
                   ) -> tuple[int, tuple[str, int]] | None:
        for i in range(start, len(q.heap)):
            gang = self.gangs[q.heap[i][2]]
            shape = (gang.job.gpu_models, gang.job.pods * gang.units)
            if shape in failed:
                continue
            flavor = self._choose_flavor(q, gang)
            if flavor is not None:
                return i, flavor
            failed.add(shape)
        return None

    def _admit_one(self, q: _QueueState, i: int, flavor: tuple[str, int], now: float) -> None:
        model, milli = flavor
        _, _, job_id = q.heap.pop(i)
        q.usage[model] = q.usage.get(model, 0) + milli
        self.flavor[job_id] = (model, milli)
        self.admitted_at[job_id] = now
        self.members[q.config.name].add(job_id)
        gang = self.gangs[job_id]
        gang.job = _restrict(gang.job, model.split(":", 1)[0])  # pods restricted to the admitted flavor
        self.placing[job_id] = gang

    # -- preemption
    def _preempt_for(self, q: _QueueState, now: float) -> None:
        """Preempt for the queue's first pending workload if that makes it fit; admit it on the freed quota."""
        job_id = q.heap[0][2]
        gang = self.gangs[job_id]
        job_queue = self.original[job_id].queue
        priority = -q.heap[0][0]
        req = gang.job.pods * gang.units * 1000
        for model in self._models(q.config, gang.job):
            if req > self._ceiling(q, model):
                continue
            victims = self._victims(q, model, req, priority)
            if victims is None:
                continue
            for v in victims:  # a borrower of another queue is reclaimed; one of its own, preempted by priority
                self._evict(v, now, "PriorityPreemption" if self.original[v].queue == job_queue else "ReclaimQuota")
            flavor = self._choose_flavor(q, gang)
            if flavor is not None:
                self._admit_one(q, q.heap.index(self._entry(self.original[job_id])), flavor, now)
            return

    def _victims(self, q: _QueueState, model: str, req: int, priority: int) -> list[str] | None:
        within_nominal = q.usage.get(model, 0) + req <= q.config.quotas[model].nominal * 1000
        candidates: list[tuple[int, int, float, str]] = []  # (own queue?, priority, -admitted at, job id)
        for name in sorted(self.queues):
            vq = self.queues[name]
            # reclaimWithinCohort: Any takes borrowers' workloads of any priority
            if vq is not q and (not within_nominal or q.config.cohort is None or vq.config.cohort != q.config.cohort
                    or model not in vq.config.quotas
                    or vq.usage.get(model, 0) <= vq.config.quotas[model].nominal * 1000):
                continue
            for job_id in sorted(self.members[name]):
                if self.flavor[job_id][0] != model:
                    continue
                p = self.prio.get(self.original[job_id].priority_class, 0)
                if vq is q and p >= priority:
                    continue  # withinClusterQueue: LowerPriority
                candidates.append((int(vq is q), p, -self.admitted_at[job_id], job_id))
        if not candidates:
            return None
        candidates.sort()
        taken: list[str] = []
        saved = {name: dict(s.usage) for name, s in self.queues.items()}
        try:
            for _, _, _, job_id in candidates:
                vq = self.queues[self.original[job_id].queue]
                if vq is not q and vq.usage.get(model, 0) <= vq.config.quotas[model].nominal * 1000:
                    continue  # that queue no longer borrows: its workloads are not reclaimable
                self._charge(job_id, -1)
                taken.append(job_id)
                if self._fits(q, model, req, borrow=True):
                    break
            else:
                return None
            for job_id in reversed(list(taken)):  # minimise: give back a victim whose release is not needed
                self._charge(job_id, +1)
                if self._fits(q, model, req, borrow=True):
                    taken.remove(job_id)
                else:
                    self._charge(job_id, -1)
            return taken
        finally:
            for name, usage in saved.items():
                self.queues[name].usage = usage

    def _charge(self, job_id: str, sign: int) -> None:
        model, milli = self.flavor[job_id]
        q = self.queues[self.original[job_id].queue]
        q.usage[model] = q.usage.get(model, 0) + sign * milli

    def _evict(self, job_id: str, now: float, reason: str = "ReclaimQuota") -> None:
        gang = self.running.pop(job_id, None)
        if gang is not None:
            ran = now - self.run_start.pop(job_id)
            lost = lost_work_s(ran, gang.job.checkpoint_interval_s)
            self._evicted.append(Preempted(job_id, lost * self.trace.gpu_milli(gang.job) / 1000, reason))
        else:
            gang = self.placing.pop(job_id)
        self._release(gang)
        self._charge(job_id, -1)
        self.flavor.pop(job_id)
        self.admitted_at.pop(job_id, None)
        job = self.original[job_id]
        self.members[job.queue].discard(job_id)
        gang.job = job
        gang.pods_left = job.pods
        insort(self.queues[job.queue].heap, self._entry(job))
