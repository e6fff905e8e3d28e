"""Defragmentation moves in the scheduler: the placement half (docs/preemption.md, "Defragmentation").

The scheduler owns placement and knows fragmentation. After a cycle, when a gang it could not place waits for GPUs
(`InsufficientGpus`, or its topology) while enough GPUs of its models are free in total, it plans moves with the
pure core (services/core/pipeline/defrag.py `plan_moves`: which checkpointing jobs to move so the gang fits, and
where each moved job lands again: its hint) and asks the preemption service, the owner of the protocol, with a
PreemptionRequested of reason DefragmentationMove (preemptor the gang, candidates the jobs to move). That service
checks the moves against its records (all or none: services/preemption/defrag.py) and runs checkpoint before
preempt; admission requeues the moved job as after any preemption. On the moved job's JobPreempted the scheduler
holds the capacity it freed for the gang (as for every preemptor) and its hint for the moved job (`hold_hint`), so
both land where the plan put them while the hold lasts (the checkpoint grace). The GPUs of the plan that are free
already are held for the gang from the ask (`hold_free`): during the checkpoint another job would take them, and the
moved job's checkpoint and restart would have been paid for nothing.

What the scheduler remembers is its own asks (table scheduler.moves, with the hints): its bound and each job's
cool-down count them, and a gang with a plan in flight (asked within the checkpoint grace) is not planned for again.
No plan is made while capacity is held for a preemptor or a moved job (the core would count it free). Off unless
queues.yaml `policy.defragmentation.enabled`, and only with a checkpoint first (`checkpoint_grace_s` above 0).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping

import asyncpg

from services.core.pipeline import WaitingJob, hold_until
from services.core.pipeline.defrag import SCATTERED, Gang, Memory, Plan, Running, plan_moves, whole_gpus
from services.core.preemption.guards import HOUR_S
from services.core.scheduler import ClusterState, CycleResult, Hold, Placement
from services.core.scheduler.index import MISSING
from services.core.scheduler.types import FREE_HOLD, HINT_HOLD
from shared.config import QueuesConfig
from shared.domain import JobSpec
from shared.events import JobPreempted, PreemptionReason, PreemptionRequested
from shared.service import Tx

# How long, in platform time, a search that found no move is trusted on an unchanged cluster (a cost bound: protection
# windows and cool-downs end without the cluster changing, and are seen at most this late).
RECHECK_S = 300.0


def gangs_waiting(cluster: ClusterState, result: CycleResult, waiting: Mapping[str, WaitingJob],
                  asks: Collection[str]) -> list[Gang]:
    """The cycle's gangs left waiting on scattered GPUs, in placement order: whole GPUs, enough of their models free
    in total, and none that asked for a priority preemption already. Cheap: no table is read."""
    free = cluster.free_gpus_by_model()
    gangs: list[Gang] = []
    for u in result.unplaceable:
        w = waiting.get(u.job_id)
        if u.reason not in SCATTERED or u.job_id in asks or w is None or not whole_gpus(w.spec):
            continue
        models = set(w.allowed_models or w.spec.gpu_models)
        if sum(n for m, n in free.items() if not models or m in models) >= w.spec.total_gpus:
            gangs.append(Gang(w.spec, tuple(w.allowed_models), int(w.priority), result.reservations.get(u.job_id)))
    return gangs


async def ask_moves(tx: Tx, cluster: ClusterState, result: CycleResult, waiting: Mapping[str, WaitingJob],
                    asks: Collection[str], queues: QueuesConfig | None, holding: Mapping[str, Hold]) -> dict[str, Hold]:
    """After a cycle: plan the moves for the gangs waiting on scattered GPUs, record them with their hints, ask the
    preemption service and hold the plans' free GPUs for their gangs (`hold_free`). `holding`: the capacity held now
    (no plan while there is any). Returns the holds made, by key."""
    if queues is None or holding:
        return {}
    settings = queues.policy.defragmentation
    if not settings.enabled or queues.policy.checkpoint_grace_s <= 0:
        return {}
    gangs = gangs_waiting(cluster, result, waiting, asks)
    if not gangs:
        return {}
    now = tx.now
    since = now - max(HOUR_S, float(settings.job_cooldown_s))
    rows = await tx.conn.fetch("SELECT job_id, gang, asked_at FROM scheduler.moves WHERE asked_at > $1 "
                               "ORDER BY asked_at, job_id", since)
    memory = Memory.empty()
    in_flight: set[str] = set()
    for r in rows:
        at = float(r["asked_at"])
        memory.move_times.append(at)
        memory.last_moved[r["job_id"]] = at
        if now - at < queues.policy.checkpoint_grace_s:
            in_flight.add(r["gang"])
    gangs = [g for g in gangs if g.spec.job_id not in in_flight]
    # a search that found nothing is not made again on the same cluster state, gangs and moves (the placed jobs'
    # specs are read from the table only then), for at most RECHECK_S of platform time: protection windows and
    # cool-downs end without the state changing
    key = ("defrag-found-nothing", tuple((g.spec.job_id, g.planned_start) for g in gangs),
           tuple(memory.move_times), int(now // RECHECK_S))
    if not gangs or cluster.state_memo(key) is not MISSING:
        return {}
    running = {r["job_id"]: Running(JobSpec.model_validate_json(r["spec"]), float(r["started_at"]))
               for r in await tx.conn.fetch(
                   "SELECT job_id, spec, coalesce(started_at, placed_at) AS started_at FROM scheduler.jobs "
                   "WHERE status = 'placed' ORDER BY job_id")}
    plans = plan_moves(cluster, gangs, running, queues, settings, memory, now)
    if not plans:
        cluster.remember(key, True)
        return {}
    await tx.conn.execute("DELETE FROM scheduler.moves WHERE asked_at <= $1", since)
    await tx.conn.executemany(
        "INSERT INTO scheduler.moves(job_id, gang, bindings, requests, asked_at) VALUES ($1, $2, $3, $4, $5) "
        "ON CONFLICT DO NOTHING",
        [(m.job_id, p.gang, _bindings(m.hint), json.dumps([list(r) for r in m.hint.requests]), now)
         for p in plans for m in p.moves])
    queue_of = {g.spec.job_id: g.spec.queue for g in gangs}
    for p in plans:
        moved = tuple(m.job_id for m in p.moves)
        await tx.emit(PreemptionRequested(
            preemptor=p.gang, queue=queue_of[p.gang], reason=PreemptionReason.DEFRAGMENTATION, candidates=moved,
            message=f"{p.gang} waits while enough GPUs are free but scattered: moving {', '.join(moved)} lets it "
                    f"start on {', '.join(sorted(p.placement.nodes))}"))
    return {h.victim: h for h in await hold_free(tx, cluster, plans, queues)}


def free_part(cluster: ClusterState, plan: Plan) -> Placement | None:
    """The part of the gang's planned placement on GPUs free now (not the moved jobs'): each pod's free GPUs, with
    its CPU and memory when all its GPUs are free (a pod sharing a node with a moved job gets those from the move).
    None: the plan uses only the moved jobs' GPUs."""
    moved: set[tuple[str, int]] = set()
    for m in plan.moves:
        if (p := cluster.placement_of(m.job_id)) is not None:
            moved.update((b.node, g) for b in p.bindings for g in b.gpu_indices)
    bindings, requests = [], []
    for i, b in enumerate(plan.placement.bindings):
        free = tuple(g for g in b.gpu_indices if (b.node, g) not in moved)
        if not free:
            continue
        bindings.append(b.model_copy(update={"gpu_indices": free}))
        whole = len(free) == len(b.gpu_indices) and plan.placement.requests
        requests.append(plan.placement.requests[i] if whole else (0, 0))
    if not bindings:
        return None
    return Placement(job_id=FREE_HOLD + plan.gang, bindings=tuple(bindings), racks_spanned=0, blocks_spanned=0,
                     gpus=sum(len(b.gpu_indices) for b in bindings), mig_slices=0, requests=tuple(requests))


async def hold_free(tx: Tx, cluster: ClusterState, plans: list[Plan], queues: QueuesConfig | None) -> list[Hold]:
    """After the asks: each plan's free GPUs held for its gang until it is placed or ends, for at most the
    checkpoint grace (the moves' checkpoints take at most that; a refused ask leaves them idle that long at most,
    and the scheduler's hourly bound caps how often). The holds written to scheduler.holds."""
    grace = float(queues.policy.checkpoint_grace_s) if queues is not None else 0.0
    holds = [Hold(preemptor=p.gang, victim=FREE_HOLD + p.gang, placement=part, until=hold_until(tx.now, grace))
             for p in plans if (part := free_part(cluster, p)) is not None]
    await tx.conn.executemany(
        "INSERT INTO scheduler.holds(victim, preemptor, bindings, requests, until) VALUES ($1, $2, $3, $4, $5) "
        "ON CONFLICT (victim) DO UPDATE SET preemptor = excluded.preemptor, bindings = excluded.bindings, "
        "requests = excluded.requests, until = excluded.until",
        [(h.victim, h.preemptor, _bindings(h.placement), json.dumps([list(r) for r in h.placement.requests]),
          h.until) for h in holds])
    return holds


async def hold_hint(tx: Tx, payload: JobPreempted, queues: QueuesConfig | None) -> asyncpg.Record | None:
    """On a job's JobPreempted: when defragmentation moved it, its hint (the holes its plan consolidates it into, its
    latest ask for that gang) held for it until it is placed again, for at most the checkpoint grace; the row of
    scheduler.holds written (None: not a move, or no ask recorded)."""
    if payload.reason is not PreemptionReason.DEFRAGMENTATION:
        return None
    grace = float(queues.policy.checkpoint_grace_s) if queues is not None else 0.0
    return await tx.conn.fetchrow(HOLD_HINT, payload.job_id, payload.preemptor, hold_until(tx.now, grace))


def _bindings(p: Placement) -> str:
    return json.dumps([b.model_dump(mode="json") for b in p.bindings])


# The moved job's hint, from its latest ask for that gang, as a hold (a row of scheduler.holds keyed `hint:<job>`).
HOLD_HINT = (
    "INSERT INTO scheduler.holds(victim, preemptor, bindings, requests, until) "
    f"SELECT '{HINT_HOLD}' || job_id, job_id, bindings, requests, $3 FROM scheduler.moves "
    "WHERE job_id = $1 AND gang = $2 "
    "ORDER BY asked_at DESC LIMIT 1 "
    "ON CONFLICT (victim) DO UPDATE SET preemptor = excluded.preemptor, bindings = excluded.bindings, "
    "requests = excluded.requests, until = excluded.until "
    "RETURNING victim, preemptor, bindings, requests, until")


__all__ = ["HOLD_HINT", "ask_moves", "free_part", "gangs_waiting", "hold_free", "hold_hint"]
