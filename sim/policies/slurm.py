"""`slurm`: Slurm's priority/multifactor ordering and EASY backfill with reservations from the users' estimates.

Semantics, with their source (Slurm documentation: "Multifactor Priority Plugin", "Classic Fairshare Algorithm",
slurm.conf `SchedulerType=sched/backfill`):
* one partition holding every node; no quota queues (a team is a Slurm account whose fair-share *shares* are its
  queue's nominal quota); no preemption (`PreemptType=preempt/none`, the default).
* job priority = w_age·age + w_fs·fairshare + w_size·job_size + w_qos·qos, each factor in [0, 1], recomputed every
  `PriorityCalcPeriod` (5 min, the default):
  - age = min(1, waited / PriorityMaxAge);
  - fairshare (classic) = 2^(−U/S): U = the account's usage decayed with `PriorityDecayHalfLife` ÷ all accounts'
    decayed usage, S = its shares ÷ all shares;
  - job size = GPUs asked ÷ cluster GPUs (`PriorityFavorSmall=NO`, the default: larger jobs first);
  - qos = the job's priority class value ÷ the highest (sites map classes to QOS).
  Weights and periods are those of the configuration example in the multifactor documentation
  (PriorityWeightFairshare=100000, PriorityWeightAge=1000, PriorityWeightJobSize=1000, PriorityMaxAge=1-0,
  PriorityDecayHalfLife=14-0), with the QOS weight at that example's partition weight (10000).
* scheduling: jobs start in priority order while they fit (a job's nodes are allocated together: whole gangs,
  first fit); the first job that does not fit gets a reservation at the earliest time the running jobs free enough
  nodes if they end at their time limits (the users' estimates; a job past its estimate "ends any moment"); later
  jobs (up to `bf_max_job_test` = 500) backfill when they fit now and either end, by their estimate, before that
  time or stay off the reserved nodes (EASY backfill: one reservation).
"""

from __future__ import annotations

import math
from bisect import insort

from sim.engine import CycleOutput
from sim.history import DecayedUsage
from sim.model import Trace, TraceJob
from sim.policies.baselines import PodFifo, Pool, _Gang
from sim.policies.gangs import place_gang

W_AGE, W_FAIRSHARE, W_SIZE, W_QOS = 1_000.0, 100_000.0, 1_000.0, 10_000.0
MAX_AGE_S = 86_400.0  # PriorityMaxAge=1-0
HALF_LIFE_S = 14 * 86_400.0  # PriorityDecayHalfLife=14-0
CALC_PERIOD_S = 300.0  # PriorityCalcPeriod default
BF_MAX_JOB_TEST = 500  # bf_max_job_test default


class Slurm(PodFifo):
    name = "slurm"

    def setup(self, trace: Trace) -> None:
        super().setup(trace)
        self.order: list[tuple[float, int, str]] = []  # (-priority, submit, job id), sorted
        self.gangs: dict[str, _Gang] = {}
        self.started_at: dict[str, float] = {}
        self.usage = DecayedUsage(HALF_LIFE_S)
        shares: dict[str, float] = {}
        for q in trace.queues.queues:
            shares[q.name] = float(sum(quota.nominal for quota in q.quotas.values()))
        total = sum(shares.values()) or 1.0
        self.shares = {name: s / total for name, s in shares.items()}
        prio = {p.name: p.value for p in trace.queues.priority_classes}
        top = max([v for v in prio.values() if v > 0], default=1)
        self.qos = {name: max(0.0, v / top) for name, v in prio.items()}
        self.capacity = max(1, trace.capacity_gpus)
        self.next_calc = 0.0

    def _priority(self, job: TraceJob, now: float) -> float:
        age = min(1.0, (now - job.submit_time) / MAX_AGE_S)
        total = sum(self.usage.usage.values())
        share = self.shares.get(job.queue, 0.0)
        if share <= 0:
            fairshare = 0.0
        else:
            fairshare = 2.0 ** (-(self.usage.usage.get(job.queue, 0.0) / total if total > 0 else 0.0) / share)
        size = min(1.0, max(job.gpus, 1) / self.capacity)
        return (W_AGE * age + W_FAIRSHARE * fairshare + W_SIZE * size
                + W_QOS * self.qos.get(job.priority_class, 0.0))

    def _enqueue(self, gang: _Gang, now: float) -> str | None:
        self.gangs[gang.job.job_id] = gang
        self.usage.advance(now)
        insort(self.order, (-self._priority(gang.job, now), gang.job.submit_time, gang.job.job_id))
        return None

    def _waiting(self) -> list[_Gang]:
        return [self.gangs[j] for _, _, j in self.order]

    def on_completion(self, job_id: str, now: float) -> None:
        gang = self.running[job_id]
        self.usage.hold(gang.job.queue, -self.trace.gpu_milli(gang.job) / 1000, now)
        super().on_completion(job_id, now)
        self.gangs.pop(job_id, None)
        self.started_at.pop(job_id, None)

    def on_node_down(self, node: str, now: float) -> list[str]:
        killed = super().on_node_down(node, now)  # releases the gangs' pods into `placing`
        for job_id, gang in list(self.placing.items()):
            del self.placing[job_id]
            self.usage.hold(gang.job.queue, -self.trace.gpu_milli(gang.job) / 1000, now)
            self.started_at.pop(job_id, None)
            self._enqueue(gang, now)  # requeued (Slurm requeues a job whose node failed)
        return killed

    def cycle(self, now: float) -> CycleOutput:
        if now >= self.next_calc:  # PriorityCalcPeriod: every pending job's priority is recomputed
            self.usage.advance(now)
            self.order = sorted((-self._priority(self.gangs[j].job, now), s, j) for _, s, j in self.order)
            self.next_calc = now + CALC_PERIOD_S
        started: list[str] = []
        kept: list[tuple[float, int, str]] = []
        shadow: float | None = None
        reserved: frozenset[tuple[Pool, int]] = frozenset()
        tested = 0
        for i, entry in enumerate(self.order):
            gang = self.gangs[entry[2]]
            if shadow is None:
                if place_gang(self.ff, gang):
                    self._start(gang, now, started)
                    continue
                shadow, reserved = self._reservation(gang, now)
                kept.append(entry)
                continue
            tested += 1
            if tested > BF_MAX_JOB_TEST or all(t.max() == 0 for t in self.ff.trees.values()):
                kept.extend(self.order[i:])
                break
            ends_before = now + gang.job.max_runtime_s <= shadow
            if place_gang(self.ff, gang, frozenset() if ends_before else reserved):
                self._start(gang, now, started)
            else:
                kept.append(entry)
        self.order = kept
        return CycleOutput(started=started)

    def _start(self, gang: _Gang, now: float, started: list[str]) -> None:
        job = gang.job
        self.running[job.job_id] = gang
        self.started_at[job.job_id] = now
        milli = self.trace.gpu_milli(job)
        self._allocated += milli
        self.usage.hold(job.queue, milli / 1000, now)
        started.append(job.job_id)

    def _reservation(self, gang: _Gang, now: float) -> tuple[float, frozenset[tuple[Pool, int]]]:
        """Shadow time and nodes of the blocked head: release the running jobs at their expected ends (start +
        estimate; overrunning ones now) on a copy of the free units until the whole gang fits first fit."""
        job = gang.job
        pools = self.ff.pools_for(job.gpu_models, gang.slices)
        free = {k: [self.ff.trees[k].t[self.ff.trees[k].size + i] for i in range(len(self.ff.names[k]))]
                for k in pools}

        units = gang.units
        count = sum(f // units for k in pools for f in free[k])  # pods that would fit, node by node

        def nodes() -> frozenset[tuple[Pool, int]]:
            """The nodes first fit would use (name order across the pools)."""
            slots = sorted((self.ff.names[k][i], k, i) for k in pools for i, f in enumerate(free[k]) if f >= units)
            taken, left = set(), job.pods
            for _, k, i in slots:
                taken.add((k, i))
                left -= free[k][i] // units
                if left <= 0:
                    break
            return frozenset(taken)

        if count >= job.pods:  # fits by count but not now: cannot happen for first fit; be safe
            return now, nodes()
        ends = sorted((max(now, self.started_at[j] + g.job.max_runtime_s), j) for j, g in self.running.items())
        pool_set = set(pools)
        for t, job_id in ends:
            held = self.running[job_id]
            for k, i in held.held:
                if k in pool_set:
                    count -= free[k][i] // units
                    free[k][i] += held.units
                    count += free[k][i] // units
            if count >= job.pods:
                return t, nodes()
        return math.inf, frozenset()
