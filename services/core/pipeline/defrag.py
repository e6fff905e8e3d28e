"""Defragmentation that keeps progress: moves of checkpointing jobs that let a waiting gang start.

A gang (an admitted job of whole GPUs) that could not be placed for want of GPUs (`InsufficientGpus`, or its
topology) while enough GPUs of its models are free in total is waiting on scattered capacity. `plan_moves`
looks, for each such gang in the pass's placement order, for a few running jobs to move: on the eligible node
closest to holding one of the gang's pods (fewest GPUs missing, then name), its smallest movable job (GPUs,
then id), again until the gang fits on the freed capacity; then every moved job must fit again on what is left
(its placement there is its hint: the holes it consolidates into). A plan that would leave a moved job without
room is no plan: defragmentation moves jobs, it never evicts them.

A job may be moved only when losing nothing but a checkpoint write: it can checkpoint (`checkpoint.supported`),
its class is preemptible and not production, it is past the protection window, its priority is not above the
gang's, it was not moved within `job_cooldown_s`, and it holds whole GPUs only. The preemption guard rails apply
as to any preemption (services/core/preemption/guards.py): a gang itself preempted within the cool-down moves
no one, and its queue's hourly limit counts the moves. Besides, at most `max_moves_per_hour` moves cluster-wide
per sliding hour and `max_moves_per_gang` per gang, and none for a gang planned (its reservation) to start
within `min_wait_saved_s` anyway. Settings: queues.yaml `policy.defragmentation` (shared/config.py).

The moves are preemptions with reason `DefragmentationMove` (their lost work is reported under that cause):
checkpoint first, requeue, the freed capacity held for the gang and the hint held for the moved job.

Pure: no I/O, no clock, deterministic (every choice sorted and tie-broken by name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from services.core.admission import AdmissionState
from services.core.preemption import cooldown_verdict, priority_of, rate_limit_verdict
from services.core.preemption.guards import HOUR_S
from services.core.scheduler import ClusterIndex, ClusterState, Placement, Reason
from shared.config import Defragmentation, QueuesConfig
from shared.domain import JobSpec

from .loop import PreemptionStage, ReplayAsks, ServiceAsks
from .pipeline import CycleOutcome, WaitingJob
from .preempt import Preempted, VictimChooser

DEFRAG = "DefragmentationMove"

# The reasons scattered capacity stands behind (a missing model, label or taint is not cured by moving jobs).
SCATTERED = frozenset({Reason.INSUFFICIENT_GPUS, Reason.TOPOLOGY_UNSATISFIABLE})

# At most this many gangs are planned for per pass (each plan copies the cluster and places a few times): a
# bound on a pass's cost, not a tuning; the next pass looks at the next ones.
MAX_GANGS_PER_PASS = 4


@dataclass(frozen=True)
class Gang:
    """A waiting gang: its spec, the models admission allowed it, its priority and its planned start (None:
    no reservation)."""

    spec: JobSpec
    allowed_models: tuple[str, ...]
    priority: int
    planned_start: float | None = None


@dataclass(frozen=True)
class Running:
    """A running job as defragmentation sees it."""

    spec: JobSpec
    started_at: float


@dataclass(frozen=True)
class Move:
    """A job moved for `gang`: it checkpoints, is requeued and lands on `hint`."""

    job_id: str
    gang: str
    gpus: int
    hint: Placement


@dataclass(frozen=True)
class Plan:
    """One gang's plan: the moves and where the gang lands once they are made."""

    gang: str
    moves: tuple[Move, ...]
    placement: Placement


@dataclass
class Memory:
    """What the bounds remember across passes: when each move was made (the hourly bound) and when each job was
    last moved (its cool-down)."""

    move_times: list[float]
    last_moved: dict[str, float]

    @classmethod
    def empty(cls) -> Memory:
        return cls([], {})

    def used(self, now: float) -> int:
        return sum(1 for t in self.move_times if now - HOUR_S < t <= now)

    def record(self, plans: Sequence[Plan], now: float) -> None:
        self.move_times = [t for t in self.move_times if now - HOUR_S < t] + [now for p in plans for _ in p.moves]
        for p in plans:
            for m in p.moves:
                self.last_moved[m.job_id] = now


def whole_gpus(spec: JobSpec) -> bool:
    """Only whole GPUs (no MIG slice, no shared GPU), at least one."""
    return spec.total_gpus > 0 and all(ps.gpus == ps.count * ps.gpus_per_pod for ps in spec.pod_sets)


def why_not_movable(job_id: str, job: Running, gang_priority: int | None, config: QueuesConfig,
                    settings: Defragmentation, memory: Memory, now: float) -> str | None:
    """Why the running job may not be moved for a gang of `gang_priority` (None: it may). With `gang_priority`
    None, every rule but the priority's."""
    spec = job.spec
    if not spec.checkpoint.supported:
        return "cannot checkpoint"
    value, preemptible, production = priority_of(config, spec)
    if production or not preemptible:
        return "production or not preemptible"
    if now - job.started_at < config.policy.protection_window_s:
        return "inside its protection window"
    if gang_priority is not None and value > gang_priority:
        return "higher priority than the gang"
    last = memory.last_moved.get(job_id)
    if last is not None and now - last < settings.job_cooldown_s:
        return "moved within its cool-down"
    if not whole_gpus(spec):
        return "not whole GPUs"
    return None


def plan_moves(cluster: ClusterState, gangs: Sequence[Gang], running: Mapping[str, Running], config: QueuesConfig,
               settings: Defragmentation, memory: Memory, now: float, *,
               last_preempted: Mapping[str, float] | None = None,
               recent_victims: Mapping[str, Sequence[float]] | None = None) -> list[Plan]:
    """The moves of this pass (the module docstring), gang by gang in the order given; `cluster` is only queried.
    `last_preempted`: when each gang was itself last preempted (the no-cascade cool-down); `recent_victims`: per
    queue, when its preemptions of the last hour were taken (its hourly limit)."""
    if not settings.enabled:
        return []
    budget = settings.max_moves_per_hour - memory.used(now)
    plans: list[Plan] = []
    work: ClusterState | None = None
    moved: set[str] = set()
    movable: dict[str, tuple[Running, int]] | None = None
    tried = 0
    for gang in gangs:
        if budget <= 0 or tried >= MAX_GANGS_PER_PASS:
            break
        spec = gang.spec
        if not _wants(gang, cluster if work is None else work, settings, now):
            continue
        if cooldown_verdict(config, (last_preempted or {}).get(spec.job_id), now) is not None:
            continue
        tried += 1
        base = cluster if work is None else work
        if movable is None:  # every rule but the gang's priority, once per pass
            movable = {j: (r, priority_of(config, r.spec)[0]) for j, r in running.items()
                       if why_not_movable(j, r, None, config, settings, memory, now) is None}
        candidates = {j: r for j, (r, value) in movable.items() if value <= gang.priority and j not in moved
                      and j != spec.job_id and base.placement_of(j) is not None}
        got = _plan_gang(base, gang, candidates, min(settings.max_moves_per_gang, budget))
        if got is None:
            continue
        plan, after = got
        recent = (recent_victims or {}).get(spec.queue, ())
        if rate_limit_verdict(config, spec.queue, recent, now, len(plan.moves)) is not None:
            continue
        plans.append(plan)
        work = after
        budget -= len(plan.moves)
        moved.update(m.job_id for m in plan.moves)
    return plans


def _wants(gang: Gang, cluster: ClusterState, settings: Defragmentation, now: float) -> bool:
    """Is the gang waiting on scattered capacity: whole GPUs, not starting soon anyway, and enough GPUs of its
    models free in total?"""
    spec = gang.spec
    if not whole_gpus(spec):
        return False
    if gang.planned_start is not None and gang.planned_start - now < settings.min_wait_saved_s:
        return False
    models = set(gang.allowed_models or spec.gpu_models)
    free = sum(n for model, n in cluster.free_gpus_by_model().items() if not models or model in models)
    return free >= spec.total_gpus


def _plan_gang(cluster: ClusterState, gang: Gang, candidates: Mapping[str, Running],
               max_moves: int) -> tuple[Plan, ClusterState] | None:
    """The moves that let `gang` fit and every moved job fit again, on a copy (returned with the plan applied)."""
    spec = gang.spec
    models = gang.allowed_models or None
    work = cluster.copy()
    per_pod = max(ps.gpus_per_pod for ps in spec.pod_sets if ps.gpus)
    released: list[str] = []
    placement = work.try_place(spec, models)
    while placement is None:
        if len(released) >= max_moves:
            return None
        pick = _next_move(work, spec, models, candidates, released, per_pod)
        if pick is None:
            return None
        work.release(pick)
        released.append(pick)
        placement = work.try_place(spec, models)
    if not released:
        return None  # it fits as it is: nothing to move (the scheduler places it)
    work.commit(placement)
    moves: list[Move] = []
    for job_id in sorted(released, key=lambda j: (-candidates[j].spec.total_gpus, j)):
        job = candidates[job_id].spec
        hint = work.try_place(job, _models_of(cluster, job_id))
        if hint is None:
            return None  # it would have nowhere to go: a move, not an eviction
        work.commit(hint)
        moves.append(Move(job_id=job_id, gang=spec.job_id, gpus=job.total_gpus, hint=hint))
    return Plan(gang=spec.job_id, moves=tuple(moves), placement=placement), work


def _models_of(cluster: ClusterState, job_id: str) -> tuple[str, ...]:
    """The GPU models a moved job runs on now: it lands on the same (its quota was admitted for them)."""
    placement = cluster.placement_of(job_id)
    assert placement is not None
    return tuple(sorted({cluster.node(n).gpu_model for n in placement.nodes}))


def _next_move(work: ClusterState, spec: JobSpec, models: tuple[str, ...] | None, candidates: Mapping[str, Running],
               released: Sequence[str], per_pod: int) -> str | None:
    """The next job to move: on the eligible node missing the fewest GPUs for one of the gang's pods (that its
    movable jobs can free; then by name), its smallest movable job (GPUs, then id)."""
    wanted = set(models or spec.gpu_models)
    on_node: dict[str, list[tuple[int, str]]] = {}
    for job_id in sorted(candidates):
        if job_id in released:
            continue
        placement = work.placement_of(job_id)
        if placement is None:
            continue
        for node in placement.nodes:
            on_node.setdefault(node, []).append(
                (sum(len(b.gpu_indices) for b in placement.bindings if b.node == node), job_id))
    best: tuple[int, str] | None = None
    for node, jobs in on_node.items():
        n = work.node(node)
        if wanted and n.gpu_model not in wanted:
            continue
        free = work.free_on(node)["gpus"]
        missing = per_pod - free
        if missing <= 0 or free + sum(g for g, _ in jobs) < per_pod:
            continue
        if best is None or (missing, node) < best:
            best = (missing, node)
    if best is None:
        return None
    smallest = min(on_node[best[1]], key=lambda gj: (candidates[gj[1]].spec.total_gpus, gj[1]))
    return smallest[1]


@dataclass(frozen=True)
class Moved(Preempted):
    """A defragmentation move as the decision loop returns it: a preemption (reason DEFRAG, preemptor the gang)
    with `hint`, where the moved job lands (a scheduler Placement on the holes it consolidates into), which the
    caller holds for it as it holds the freed capacity for the gang."""

    hint: Placement | None = None


class Defragmenter:
    """The decision loop's defragmentation step (`PreemptionStage`, loop.py): after a pass's preemptions, the
    moves for the gangs left waiting on scattered capacity, as `Preempted` (reason DEFRAG, checkpoint first,
    with their hint), with the bounds' memory across passes. `moves`: how many it has made."""

    def __init__(self, config: QueuesConfig, settings: Defragmentation | None = None, *,
                 checkpoint_write_s: float = 30.0):
        self.config = config
        self.settings = settings if settings is not None else config.policy.defragmentation
        self.checkpoint_write_s = checkpoint_write_s
        self.memory = Memory.empty()
        self.moves = 0

    def __call__(self, out: Any, cluster: ClusterIndex, waiting: Mapping[str, Any], running: Mapping[str, Any],
                 victims: Sequence[Preempted], now: float, *, last_preempted: dict[str, float],
                 by_queue: dict[str, list[float]]) -> list[Preempted]:
        """The pass's moves. `out`: the pass's CycleOutcome; `cluster`: the snapshot its placements left;
        `running`: job id -> RunningInfo; `victims`: the pass's preemptions (their preemptors are served, their
        capacity free); `last_preempted`/`by_queue`: the victim chooser's guard-rail memory, charged here too."""
        if not self.settings.enabled:
            return []
        gangs = _gangs(out, waiting, {v.preemptor for v in victims})
        if not gangs:
            return []
        taken = {v.job_id for v in victims}
        base = cast(ClusterState, cluster)  # the decision loop's snapshot: a ClusterState (placement queries)
        if taken:
            base = base.copy()
            base.release_many(sorted(j for j in taken if cluster.placement_of(j) is not None))
        alive = {j: Running(i.spec, i.started_at) for j, i in running.items() if j not in taken}
        plans = plan_moves(base, gangs, alive, self.config, self.settings, self.memory, now,
                           last_preempted=last_preempted, recent_victims=by_queue)
        self.memory.record(plans, now)
        grace = float(self.config.policy.checkpoint_grace_s)
        moved: list[Preempted] = []
        queue_of = {g.spec.job_id: g.spec.queue for g in gangs}
        for plan in plans:
            for m in plan.moves:
                ran = now - alive[m.job_id].started_at
                moved.append(Moved(job_id=m.job_id, lost_gpu_s=m.gpus * min(self.checkpoint_write_s, ran),
                                   reason=DEFRAG, preemptor=plan.gang, checkpoint_first=grace > 0,
                                   grace_s=grace, hint=m.hint))
                by_queue.setdefault(queue_of[plan.gang], []).append(now)
                last_preempted[m.job_id] = now
        self.moves += len(moved)
        return moved


class DefragmentingStage(PreemptionStage):
    """The decision loop's preemption stage with the defragmentation step after the pass's preemptions: `decide`
    (loop.py) returns the moves among its preemptions. `defrag`: its Defragmenter (its bounds' memory)."""

    def __init__(self, chooser: VictimChooser, asks: ServiceAsks | ReplayAsks,
                 defrag: Defragmenter | None = None) -> None:
        super().__init__(chooser, asks)
        self.defrag = defrag if defrag is not None else Defragmenter(
            chooser.config, checkpoint_write_s=chooser.checkpoint_write_s)

    def choose(self, out: CycleOutcome, state: AdmissionState, cluster: ClusterIndex,
               waiting: Mapping[str, WaitingJob], now: float) -> list[Preempted]:
        victims = super().choose(out, state, cluster, waiting, now)
        moves = self.defrag(out, cluster, waiting, self.running, victims, now,
                            last_preempted=self.chooser.last_preempted, by_queue=self.chooser.by_queue)
        for m in moves:
            self.stopped(m.job_id)
        return victims + moves


def preemption_stage(chooser: VictimChooser, asks: ServiceAsks | ReplayAsks) -> PreemptionStage:
    """The stage the queues ask for: with defragmentation when `policy.defragmentation.enabled` and victims
    checkpoint (a move without a checkpoint would lose the moved job's work), else the plain one."""
    if chooser.config.policy.defragmentation.enabled and chooser.checkpointing:
        return DefragmentingStage(chooser, asks)
    return PreemptionStage(chooser, asks)


def _gangs(out: Any, waiting: Mapping[str, Any], served: set[str | None]) -> list[Gang]:
    """The pass's gangs left waiting for GPUs, in placement order, but those a preemption already serves."""
    result = out.placement.result
    admitted = {w.job_id: w for w in out.admitted}
    gangs: list[Gang] = []
    for u in result.unplaceable:
        if u.reason not in SCATTERED or u.job_id in served:
            continue
        w = admitted.get(u.job_id) or waiting.get(u.job_id)
        if w is not None:
            gangs.append(Gang(w.spec, tuple(w.allowed_models), int(w.priority), result.reservations.get(u.job_id)))
    return gangs


__all__ = [
    "DEFRAG",
    "SCATTERED",
    "Defragmenter",
    "DefragmentingStage",
    "Gang",
    "Memory",
    "Move",
    "Plan",
    "Running",
    "plan_moves",
    "preemption_stage",
    "whole_gpus",
    "why_not_movable",
]
