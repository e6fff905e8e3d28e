"""The two baselines, as policies of the same engine, each with its own best simple behaviour.

* `pod-fifo` — the default Kubernetes scheduler with no queueing layer: every pod of every job is placed
  one by one, first come first served, first fit; no gang. A partly placed job holds its GPUs idle until all
  its pods run (counted as idle partial-gang GPU-hours). A pod that does not fit does not block later pods
  (the scheduler moves on, as kube-scheduler's backoff queue does).
* `quota-fifo` — a plain Kueue setup: quotas with borrowing in a cohort, StrictFIFO per queue (priority,
  then submit time; a head that does not fit blocks its queue), gang checked only against quota; then
  the admitted job's pods go to the same pod-by-pod first-fit placer (no backfill, no topology).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from shared.config import QueueConfig
from sim.engine import CycleOutput
from sim.model import Trace, TraceJob
from sim.policies.firstfit import FirstFit

Pool = tuple[str, bool]


@dataclass
class _Gang:
    job: TraceJob
    slices: bool
    units: int  # per pod: GPUs, or 1 slice
    pods_left: int
    held: list[tuple[Pool, int]] = field(default_factory=list)


class PodFifo:
    """Pods placed one by one, FCFS, first fit; partial gangs hold GPUs."""

    name = "pod-fifo"

    def setup(self, trace: Trace) -> None:
        self.trace = trace
        self.ff = FirstFit(trace.nodes)
        self.placing: dict[str, _Gang] = {}  # insertion order = FIFO order
        self.running: dict[str, _Gang] = {}
        self._allocated = 0
        self._changed = True
        self.slot_of = {name: (k, i) for k in self.ff.keys for i, name in enumerate(self.ff.names[k])}
        self.down: dict[str, int] = {}  # failed node -> the free units taken out of its pool

    # -- engine hooks
    def on_arrival(self, job: TraceJob, now: float) -> str | None:
        gang = self._gang(job)
        if not self.ff.pools_for(job.gpu_models, gang.slices) or \
                all(max(self.ff.capacity[k]) < gang.units for k in self.ff.pools_for(job.gpu_models, gang.slices)):
            return "Unschedulable"
        return self._enqueue(gang, now)

    def on_completion(self, job_id: str, now: float) -> None:
        gang = self.running.pop(job_id)
        self._release(gang)

    def on_node_down(self, node: str, now: float) -> list[str]:
        """Every gang with a pod on the node gives back all its pods and starts placing again, ahead of the
        others (it was started or being placed before them); quota-fifo keeps its admission (Kueue leaves
        the workload admitted while the job controller recreates pods)."""
        slot = self.slot_of.get(node)
        if slot is None or node in self.down:
            return []
        killed = [j for j, g in self.running.items() if slot in g.held]
        restart = {}
        for source in (self.running, self.placing):  # running gangs, then partly placed ones
            for job_id in [j for j, g in source.items() if slot in g.held]:
                gang = source.pop(job_id)
                self._release(gang)
                gang.pods_left = gang.job.pods
                restart[job_id] = gang
        self.placing = {**restart, **self.placing}
        pool, idx = slot
        tree = self.ff.trees[pool]
        free = tree.t[tree.size + idx]
        tree.add(idx, -free)
        self.down[node] = free
        return killed

    def on_node_up(self, node: str, now: float) -> None:
        free = self.down.pop(node, None)
        if free is not None:
            pool, idx = self.slot_of[node]
            self.ff.trees[pool].add(idx, free)

    def cycle(self, now: float) -> CycleOutput:
        self._admit(now)
        started = self._place_pods()
        return CycleOutput(started=started)

    def allocated_milli(self) -> int:
        return self._allocated

    def fragmentation(self) -> int:
        """Free GPUs on nodes where no waiting pod fits (free slices count as their fraction of a GPU)."""
        min_units: dict[Pool, int] = {}
        waiting = self._waiting()
        if not waiting:
            return 0
        for gang in waiting:
            for k in self.ff.pools_for(gang.job.gpu_models, gang.slices):
                min_units[k] = min(min_units.get(k, gang.units), gang.units)
        milli = 0
        for k, free in self.ff.free_units():
            if free < min_units.get(k, 1 << 30):
                milli += free * self.ff.slice_milli[k]
        return milli // 1000

    # -- overridable by quota-fifo
    def _enqueue(self, gang: _Gang, now: float) -> str | None:
        self.placing[gang.job.job_id] = gang
        return None

    def _admit(self, now: float) -> None:
        return None

    def _waiting(self) -> list[_Gang]:
        return list(self.placing.values())

    # -- helpers
    def _gang(self, job: TraceJob) -> _Gang:
        slices = job.mig_profile is not None
        return _Gang(job=job, slices=slices, units=1 if slices else job.gpus_per_pod, pods_left=job.pods)

    def _place_pods(self) -> list[str]:
        started: list[str] = []
        for job_id, gang in self.placing.items():
            if all(t.max() == 0 for t in self.ff.trees.values()):
                break  # nothing free anywhere: nobody else can place a pod this cycle
            while gang.pods_left and self.ff.max_free(gang.job.gpu_models, gang.slices) >= gang.units:
                slot = self.ff.place_pod(gang.job.gpu_models, gang.slices, gang.units)
                if slot is None:
                    break
                gang.held.append(slot)
                gang.pods_left -= 1
                self._allocated += gang.units * self.ff.slice_milli[slot[0]]
            if gang.pods_left == 0:
                started.append(job_id)
        for job_id in started:
            self.running[job_id] = self.placing.pop(job_id)
        return started

    def _release(self, gang: _Gang) -> None:
        for pool, idx in gang.held:
            self.ff.free(pool, idx, gang.units)
            self._allocated -= gang.units * self.ff.slice_milli[pool]
        gang.held.clear()


@dataclass
class _QueueState:
    config: QueueConfig
    usage: dict[str, int] = field(default_factory=dict)  # model -> milli-GPUs admitted
    heap: list[tuple[int, int, str]] = field(default_factory=list)  # (-priority, submit, job_id)


class QuotaFifo(PodFifo):
    """Kueue-like quota admission (StrictFIFO per queue, borrowing in the cohort), then pod-by-pod first fit."""

    name = "quota-fifo"

    def setup(self, trace: Trace) -> None:
        super().setup(trace)
        self.queues = {q.name: _QueueState(q) for q in trace.queues.queues}
        self.prio = {p.name: p.value for p in trace.queues.priority_classes}
        self.gangs: dict[str, _Gang] = {}
        self.flavor: dict[str, tuple[str, int]] = {}  # admitted job -> (model, milli charged)

    def _queue_for(self, gang: _Gang) -> _QueueState | str:
        """The gang's queue, or why it can never be admitted there (Kueue's inadmissible reasons)."""
        q = self.queues.get(gang.job.queue)
        if q is None:
            return "UnknownQueue"
        models = self._models(q.config, gang.job)
        if not models:
            return "InadmissibleNoFlavor"
        req = gang.job.pods * gang.units * 1000  # a slice is one unit of its "<model>:<profile>" quota
        if all(req > self._ceiling(q, m) for m in models):
            return "InadmissibleExceedsLimits"
        return q

    def _enqueue(self, gang: _Gang, now: float) -> str | None:
        q = self._queue_for(gang)
        if isinstance(q, str):
            return q
        self.gangs[gang.job.job_id] = gang
        heapq.heappush(q.heap, (-self.prio.get(gang.job.priority_class, 0), gang.job.submit_time, gang.job.job_id))
        return None

    def on_completion(self, job_id: str, now: float) -> None:
        super().on_completion(job_id, now)
        model, milli = self.flavor.pop(job_id)
        q = self.queues[self.gangs.pop(job_id).job.queue]
        q.usage[model] -= milli

    def _waiting(self) -> list[_Gang]:
        waiting = list(self.placing.values())
        for q in self.queues.values():
            waiting.extend(self.gangs[jid] for _, _, jid in q.heap)
        return waiting

    @staticmethod
    def _models(q: QueueConfig, job: TraceJob) -> list[str]:
        """Quota resources the job may be charged to, in its any-of order: the model, or for a MIG-slice pod
        "<model>:<profile>" when the queue has such a quota (the admission core's naming)."""
        models = job.gpu_models or tuple(sorted({k.split(":", 1)[0] for k in q.quotas}))
        out = []
        for m in models:
            key = f"{m}:{job.mig_profile}" if job.mig_profile else m
            if key in q.quotas:
                out.append(key)
            elif m in q.quotas:
                out.append(m)
        return out

    def _ceiling(self, q: _QueueState, model: str) -> int:
        """The most this queue could ever hold of `model`: nominal + borrowing, capped by the cohort."""
        quota = q.config.quotas[model]
        if q.config.cohort is None:
            return quota.nominal * 1000
        cohort = 0
        for other in self.queues.values():
            if other.config.cohort == q.config.cohort and model in other.config.quotas:
                oq = other.config.quotas[model]
                cohort += oq.nominal if other is q or oq.lending_limit is None else oq.lending_limit
        if quota.borrowing_limit is not None:
            cohort = min(cohort, quota.nominal + quota.borrowing_limit)
        return cohort * 1000

    def _fits(self, q: _QueueState, model: str, req: int, borrow: bool) -> bool:
        """Within the queue's nominal quota (or, borrowing, its nominal + borrowing limit), and within what the
        cohort has: the cohort's usage beyond each queue's guaranteed part (nominal − lending limit) may not
        exceed the lendable quota of all its queues. Quota lent to a borrower is in use: the lender gets it back
        only when the borrower ends (or, under `kueue`, by reclaim)."""
        quota = q.config.quotas[model]
        used = q.usage.get(model, 0)
        if used + req > quota.nominal * 1000:
            if not borrow or q.config.cohort is None:
                return False
            if quota.borrowing_limit is not None and used + req > (quota.nominal + quota.borrowing_limit) * 1000:
                return False
        if q.config.cohort is None:
            return True
        lendable_total = beyond_guaranteed = 0
        for other in self.queues.values():
            if other.config.cohort != q.config.cohort or model not in other.config.quotas:
                continue
            oq = other.config.quotas[model]
            lendable = oq.nominal if oq.lending_limit is None else min(oq.nominal, oq.lending_limit)
            guaranteed = (oq.nominal - lendable) * 1000
            lendable_total += lendable * 1000
            used_o = other.usage.get(model, 0) + (req if other is q else 0)
            beyond_guaranteed += max(0, used_o - guaranteed)
        return beyond_guaranteed <= lendable_total

    def _choose_flavor(self, q: _QueueState, gang: _Gang) -> tuple[str, int] | None:
        req = gang.job.pods * gang.units * 1000  # a slice is one unit of its "<model>:<profile>" quota
        models = self._models(q.config, gang.job)
        for borrow in (False, True):  # Kueue: prefer a fit without borrowing
            for m in models:
                if self._fits(q, m, req, borrow):
                    return m, req
        return None

    def _admit(self, now: float) -> None:
        while True:
            best: tuple[tuple[int, int, str], _QueueState, tuple[str, int]] | None = None
            for name in sorted(self.queues):
                q = self.queues[name]
                if not q.heap:
                    continue
                head = q.heap[0]
                if best is not None and head >= best[0]:
                    continue
                flavor = self._choose_flavor(q, self.gangs[head[2]])
                if flavor is not None:
                    best = (head, q, flavor)
            if best is None:
                return
            head, q, (model, milli) = best
            heapq.heappop(q.heap)
            q.usage[model] = q.usage.get(model, 0) + milli
            self.flavor[head[2]] = (model, milli)
            gang = self.gangs[head[2]]
            # Kueue admits the workload for one flavor: its pods are then restricted to that model.
            gang.job = _restrict(gang.job, model.split(":", 1)[0])
            self.placing[head[2]] = gang


def _restrict(job: TraceJob, model: str) -> TraceJob:
    return replace(job, gpu_models=(model,))
