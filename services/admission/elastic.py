"""What admission charges a running elastic job (issue 48; docs/admission.md, docs/scheduler.md "Elastic jobs").

Admission is the one owner of quota charges. An elastic job is admitted for its floor; while it runs:

- `JobGrowRequested` (the scheduler found idle GPUs for `pods` pods): the pods above what is charged are charged
  when the queue's growth room holds them (the decision core's rule, `growth_room`: its nominal quota, then what its
  cohort lends; only the nominal while a job of its cohort waits for admission, nothing while one of its own queue
  does), and `JobResizeAdmitted` answers, granted or not. The grant is kept (`grow_granted`) until the scheduler
  says what it placed.
- `JobResized` (the scheduler's placement changed): the job is charged exactly the pods it names, never less than a
  grant still unanswered (a shrink for a waiting job may cross a grant on the bus; the grant's own JobResized
  settles it).
- After each admission cycle (`give_back`): while a job the configuration can admit waits for admission in an
  elastic job's queue, its pods above the floor are asked back; while one waits elsewhere in its cohort, those
  above its queue's nominal quota (`JobResizeAdmitted` below the placed size, kept in `asked_back`). The charge goes
  when the scheduler has taken them back (its JobResized), and the cohort's reclaims wait until then, so no one is
  preempted for quota a grown pod held.

Each change is the job row's `usage` and `charged_pods` (`grow_granted`, `asked_back`) written in the unit of work
that emits the answer: the runtime's inbox and outbox make a redelivered event change nothing twice, and the
charge is a function of the pods named, never an increment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import asyncpg

from services.admission.memory import Memory, UnitOfWork
from services.core.admission import (
    AdmissionState,
    ReclaimRequest,
    above_floor,
    charge_running,
    cohort_waits,
    growth_room,
    over_nominal,
    queue_waits,
    quota_keys,
)
from shared.events import CloudEvent, JobGrowRequested, JobResizeAdmitted, JobResized
from shared.service import Tx


class ElasticCharges:
    """The running elastic jobs' charged pods (above their floor only), grants unanswered and pods asked back, by
    job, mirrored from admission.jobs; and the handlers of the scheduler's JobGrowRequested and JobResized."""

    def __init__(self, memory: Memory, unit: UnitOfWork) -> None:
        self.memory, self.unit = memory, unit
        self.charged: dict[str, int] = {}
        self.granted: dict[str, int] = {}
        self.asked_back: dict[str, int] = {}

    async def load(self, conn: asyncpg.Connection) -> None:
        self.charged.clear()
        self.granted.clear()
        self.asked_back.clear()
        for r in await conn.fetch("SELECT job_id, charged_pods, grow_granted, asked_back FROM admission.jobs "
                                  "WHERE status = 'admitted' AND (charged_pods IS NOT NULL OR grow_granted IS NOT NULL "
                                  "OR asked_back IS NOT NULL) ORDER BY job_id"):
            for table, value in ((self.charged, r["charged_pods"]), (self.granted, r["grow_granted"]),
                                 (self.asked_back, r["asked_back"])):
                if value is not None:
                    table[r["job_id"]] = int(value)

    def pods(self, state: AdmissionState, job_id: str) -> int | None:
        a = state.admitted.get(job_id)
        if a is None or not a.spec.elastic:
            return None
        return self.charged.get(job_id, a.spec.min_pods)

    async def _write(self, tx: Tx, state: AdmissionState, job_id: str) -> None:
        a = state.admitted[job_id]
        await tx.conn.execute(
            "UPDATE admission.jobs SET usage = $2::jsonb, charged_pods = $3, grow_granted = $4, asked_back = $5 "
            "WHERE job_id = $1", job_id, json.dumps(a.usage), self.charged.get(job_id),
            self.granted.get(job_id), self.asked_back.get(job_id))

    def _charge(self, state: AdmissionState, job_id: str, pods: int) -> None:
        before = self.pods(state, job_id)
        assert before is not None
        charge_running(state, job_id, before, pods)
        self.charged[job_id] = pods

    async def on_grow_requested(self, tx: Tx, event: CloudEvent, payload: JobGrowRequested) -> None:
        """The scheduler found GPUs for a running elastic job's next pods: charged if its queue's growth room holds
        them, and answered; then a cycle."""
        async def body() -> None:
            if await self.grow(tx, self.memory.state, payload):
                self.memory.changed()

        await self.unit.then_cycle(tx, body)

    async def on_resized(self, tx: Tx, event: CloudEvent, payload: JobResized) -> None:
        """The scheduler grew or shrank a running elastic job: it is charged what it runs; a cycle then admits what a
        shrink made room for."""
        async def body() -> None:
            if await self.resized(tx, self.memory.state, payload):
                self.memory.changed()

        await self.unit.then_cycle(tx, body)

    async def grow(self, tx: Tx, state: AdmissionState, payload: JobGrowRequested) -> bool:
        """Charge the pods asked for if the queue's growth room holds them; answer either way. True: charged."""
        job_id = payload.job_id
        charged = self.pods(state, job_id)
        if charged is None:
            return False  # not running here any more (its end releases what it held); the scheduler forgets it too
        a = state.admitted[job_id]
        target = min(payload.pods, a.spec.total_pods)
        keys = quota_keys(state, a.spec.queue)
        now, more = above_floor(a.spec, a.flavors, charged, keys), above_floor(a.spec, a.flavors, target, keys)
        memo: dict[str, bool] = {}
        short = sorted(r for r, n in more.items() if n - now.get(r, 0) > growth_room(state, a.spec.queue, r, memo))
        if short or target <= payload.pods_before:
            message = (f"queue {a.spec.queue} has no room to grow {job_id} to {target} pods ({', '.join(short)})"
                       if short else "")
            await tx.emit(JobResizeAdmitted(job_id=job_id, pods=payload.pods_before, granted=False,
                                            quota=dict(a.usage), message=message))
            return False
        if target > charged:
            self._charge(state, job_id, target)
        self.granted[job_id] = target
        await self._write(tx, state, job_id)
        await tx.emit(JobResizeAdmitted(job_id=job_id, pods=target, granted=True,
                                        quota=dict(state.admitted[job_id].usage)))
        return True

    async def resized(self, tx: Tx, state: AdmissionState, payload: JobResized) -> bool:
        """Charge exactly what the scheduler placed (no less than a grant it has not answered). True: changed."""
        job_id = payload.job_id
        if self.pods(state, job_id) is None:
            return False
        pods = payload.pods
        if payload.reason == "Grow":
            self.granted.pop(job_id, None)
        elif job_id in self.granted:
            pods = max(pods, self.granted[job_id])
        if job_id in self.asked_back and payload.pods <= self.asked_back[job_id]:
            self.asked_back.pop(job_id)
        self._charge(state, job_id, pods)
        await self._write(tx, state, job_id)
        return True

    def admitted(self, job_ids: Iterable[str]) -> list[str]:
        """Jobs (re-)admitted this cycle start at their floor: what was kept of an earlier run goes."""
        out = []
        for job_id in job_ids:
            if job_id in self.charged or job_id in self.granted or job_id in self.asked_back:
                for table in (self.charged, self.granted, self.asked_back):
                    table.pop(job_id, None)
                out.append(job_id)
        return out

    async def give_back(self, tx: Tx, state: AdmissionState) -> set[str]:
        """Ask back the pods above a floor that keep a job out (the module docstring). Returns the queues with pods
        asked back and not yet given (their cohorts' reclaims wait)."""
        memo: dict[str, bool] = {}
        for job_id in sorted(self.charged):
            a = state.admitted.get(job_id)
            pods = self.pods(state, job_id)
            if a is None or pods is None:
                self.charged.pop(job_id, None)
                self.granted.pop(job_id, None)
                self.asked_back.pop(job_id, None)
                continue
            if pods <= a.spec.min_pods:
                continue
            if queue_waits(state, a.spec.queue, memo):
                target = a.spec.min_pods
            elif cohort_waits(state, a.spec.queue, memo):
                model = next((a.flavors.get(ps.name) for ps in a.spec.pod_sets if ps.elastic), None)
                over = over_nominal(state, a.spec.queue, model) if model is not None else 0
                per_pod = max(1, next(ps.gpus_per_pod for ps in a.spec.pod_sets if ps.elastic))
                target = max(a.spec.min_pods, pods - -(-over // per_pod)) if over > 0 else pods
            else:
                continue
            if target >= pods or self.asked_back.get(job_id, pods) <= target:
                continue
            self.asked_back[job_id] = target
            await self._write(tx, state, job_id)
            await tx.emit(JobResizeAdmitted(
                job_id=job_id, pods=target, granted=True, quota=dict(a.usage),
                message=f"pods above {target} given back: a job waits for admission in queue {a.spec.queue}"
                        + ("" if queue_waits(state, a.spec.queue, memo) else "'s cohort")))
        return {state.admitted[j].spec.queue for j in self.asked_back if j in state.admitted}

    async def reclaims_after_give_back(self, tx: Tx, reclaims: Iterable[ReclaimRequest]) -> list[ReclaimRequest]:
        """`give_back`, then the cycle's reclaims less those of cohorts where pods are being given back (they wait
        for the next cycle, after the scheduler took the pods back: no one is preempted for quota they held)."""
        state = self.memory.state
        giving = await self.give_back(tx, state)
        if not giving:
            return list(reclaims)
        cohort = {q.name: q.cohort for q in state.config.queues}
        held = {cohort.get(q) or f"queue:{q}" for q in giving}
        return [r for r in reclaims if (cohort.get(r.queue) or f"queue:{r.queue}") not in held]

    async def reset(self, tx: Tx, job_ids: Iterable[str]) -> None:
        """Jobs (re-)admitted this cycle start at their floor: what was kept of an earlier run goes."""
        ids = list(job_ids)
        self.admitted(ids)
        if ids:  # (the row of a job requeued before a restart may keep them: memory did not)
            await tx.conn.execute("UPDATE admission.jobs SET charged_pods = NULL, grow_granted = NULL, "
                                  "asked_back = NULL WHERE job_id = ANY($1::text[]) AND (charged_pods IS NOT NULL "
                                  "OR grow_granted IS NOT NULL OR asked_back IS NOT NULL)", ids)


__all__ = ["ElasticCharges"]
