"""`volcano`: Volcano's default scheduler configuration: gang, proportion, priority, backfill without reservation.

Semantics, with their source (volcano-sh/volcano: the default `volcano-scheduler.conf` actions "enqueue, allocate,
backfill" and plugins priority, gang, drf, proportion; pkg/scheduler/plugins/proportion and actions/allocate):
* **gang**: a job is bound only when every pod has a place (first fit, node by node); otherwise nothing is held.
* **proportion**: each queue (team) has a weight, here its nominal quota in GPUs (at least 1). Its *deserved*
  share is water-filled: capacity is split by weight, a queue never deserves more than it asks for (allocated +
  pending), and what it does not need goes to the others by weight. A queue whose allocation reached its
  deserved share is *overused* and gets nothing more this cycle. Queues are served lowest allocated ÷ deserved
  first (ties by name), one job at a time.
* job order within a queue: priority class (the priority plugin), then creation time. DRF's job order compares
  the dominant share a job already holds, which is zero for every pending gang, so it breaks no ties here.
* **no reservation**: a job that does not fit is skipped and the next one is tried (allocate + backfill);
  nothing waits for a big gang, which can starve. No preemption or reclaim (not in the default actions).
"""

from __future__ import annotations

from bisect import insort

from sim.engine import CycleOutput
from sim.model import Trace
from sim.policies.baselines import PodFifo, _Gang
from sim.policies.gangs import place_gang


def water_fill(capacity: float, weights: dict[str, float], demand: dict[str, float]) -> dict[str, float]:
    """Proportion's deserved shares: split `capacity` by weight, never above a queue's demand, redistributing
    what satisfied queues leave over (deterministic: queues in name order)."""
    deserved = dict.fromkeys(weights, 0.0)
    left = capacity
    active = sorted(q for q in weights if demand.get(q, 0.0) > 0)
    while left > 1e-9 and active:
        total = sum(weights[q] for q in active)
        satisfied = []
        for q in active:
            offer = left * weights[q] / total
            need = demand[q] - deserved[q]
            if need <= offer:
                satisfied.append(q)
        if not satisfied:
            for q in active:
                deserved[q] += left * weights[q] / total
            break
        for q in satisfied:
            left -= demand[q] - deserved[q]
            deserved[q] = demand[q]
        active = [q for q in active if q not in satisfied]
    return deserved


class Volcano(PodFifo):
    name = "volcano"

    def setup(self, trace: Trace) -> None:
        super().setup(trace)
        self.prio = {p.name: p.value for p in trace.queues.priority_classes}
        self.weights = {q.name: max(1.0, float(sum(quota.nominal for quota in q.quotas.values())))
                        for q in trace.queues.queues}
        self.pending: dict[str, list[tuple[int, int, str]]] = {q: [] for q in self.weights}
        self.gangs: dict[str, _Gang] = {}
        self.allocated: dict[str, float] = dict.fromkeys(self.weights, 0.0)  # queue -> GPUs held
        self.asked: dict[str, float] = dict.fromkeys(self.weights, 0.0)  # queue -> GPUs its pending jobs ask
        self.capacity = float(trace.capacity_gpus)

    def _enqueue(self, gang: _Gang, now: float) -> str | None:
        job = gang.job
        if job.queue not in self.pending:
            return "UnknownQueue"
        self.gangs[job.job_id] = gang
        self.asked[job.queue] += self.trace.gpu_milli(job) / 1000
        insort(self.pending[job.queue], (-self.prio.get(job.priority_class, 0), job.submit_time, job.job_id))
        return None

    def _waiting(self) -> list[_Gang]:
        return [self.gangs[j] for q in sorted(self.pending) for _, _, j in self.pending[q]]

    def on_completion(self, job_id: str, now: float) -> None:
        gang = self.running[job_id]
        self.allocated[gang.job.queue] -= self.trace.gpu_milli(gang.job) / 1000
        super().on_completion(job_id, now)
        self.gangs.pop(job_id, None)

    def on_node_down(self, node: str, now: float) -> list[str]:
        killed = super().on_node_down(node, now)  # releases the gangs' pods into `placing`
        for job_id, gang in list(self.placing.items()):
            del self.placing[job_id]
            self.allocated[gang.job.queue] -= self.trace.gpu_milli(gang.job) / 1000
            self.gangs.pop(job_id, None)
            self._enqueue(gang, now)
        return killed

    def cycle(self, now: float) -> CycleOutput:
        demand = {q: self.allocated[q] + self.asked[q] for q in self.pending}
        deserved = water_fill(self.capacity, self.weights, demand)
        started: list[str] = []
        cursor = dict.fromkeys(self.pending, 0)
        failed: set[tuple[tuple[str, ...], bool, int, int]] = set()  # gang shapes that did not fit this cycle
        live = sorted(q for q, lst in self.pending.items() if lst)
        while live:
            if all(t.max() == 0 for t in self.ff.trees.values()):
                break
            q = min(live, key=lambda name: (self.allocated[name] / deserved[name] if deserved[name] > 0
                                            else float("inf"), name))
            lst = self.pending[q]
            if self.allocated[q] >= deserved[q] - 1e-9 or cursor[q] >= len(lst):
                live.remove(q)  # overused, or nothing left to try
                continue
            job_id = lst[cursor[q]][2]
            gang = self.gangs[job_id]
            shape = (gang.job.gpu_models, gang.slices, gang.units, gang.job.pods)
            if shape not in failed and place_gang(self.ff, gang):
                lst.pop(cursor[q])
                self.running[job_id] = gang
                milli = self.trace.gpu_milli(gang.job)
                self._allocated += milli
                self.allocated[q] += milli / 1000
                self.asked[q] -= milli / 1000
                started.append(job_id)
            else:
                failed.add(shape)  # free capacity only shrinks within a cycle: the same shape fails again
                cursor[q] += 1
        return CycleOutput(started=started)
