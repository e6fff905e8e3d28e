"""One scheduling cycle over the ordered pending list, with EASY backfill (Slurm) and reservations.

Phases, per pending job in the caller's order (admission order):
1. place it on the current state; if it fits and does not touch a reservation it would outlive, commit;
2. if it does not fit and reservations are left (`max_reservations`), reserve the earliest future slot:
   replay the running jobs' expected ends (started_at + max_runtime_s) on a copy of the state until the
   job fits; its planned start is exposed in `CycleResult.reservations` (feeds the ETA);
3. a later job may start now only if it ends before every reservation it overlaps, or if it uses none of
   the GPUs, slices, CPU or memory those reservations will need; otherwise it is `WaitingForReservation`.

Without backfill (`backfill=False`) the first job that gets a reservation blocks every later job (strict
order); a job that can never fit gets no reservation and blocks nothing.
Several reservations (`max_reservations > 1`) never share resources: a later reservation is planned
avoiding every earlier one's GPUs for its whole duration (conservative: it never delays an earlier one).

Incremental: a job's placement attempt and its reservation search are pure functions of the state, the job
(spec, allowed models) and, for the search, the timeline and the earlier reservations. They are remembered on
the state (`ClusterIndex.state_memo`, dropped by any commit, release or node update) with those other inputs,
so a cycle that finds the state as an earlier one left it (an arrival that starts nothing, a wake-up) answers
from memory; the answer is the same object the computation would return again. A reservation is kept as its
instant and placement: its start is max(now, instant) (an overrunning job's end is in the past).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from shared.domain import JobSpec
from shared.timefmt import human_time

from .index import MISSING, ClusterIndex
from .placer import place_job
from .slot import Reservation, earliest_instant, earliest_slot
from .staging import Exclusion, exclusions_for, placement_shape
from .types import CycleResult, Hold, PendingJob, Placement, Reason, RunningJob, Unplaceable

# Reasons that releasing running jobs cannot cure: no reservation is searched for them.
_STATIC = {Reason.NO_GPU_MODEL, Reason.UNTOLERATED, Reason.NO_MATCHING_NODE, Reason.NO_READY_NODES}


def schedule_cycle(state: ClusterIndex, pending: Sequence[PendingJob], running: Sequence[RunningJob], now: float,
                   *, backfill: bool = True, max_reservations: int = 1,
                   timeline: Sequence[tuple[float, str]] | None = None,
                   holds: Sequence[Hold] = ()) -> CycleResult:
    """Place what can start now, reserve for blocked heads, backfill around the reservations.

    Commits every placed job into `state` (pass `state.copy()` for a dry run). `timeline`: the running jobs'
    (expected end, job id), sorted, when the caller keeps it up to date (a simulator cycle sorting every
    running job again was a cost per cycle linear in the cluster); else it is built from `running`.
    `holds`: capacity freed by preemptions and held for their preemptors (free on `state`); a hold whose `until`
    has passed holds nothing. Only its preemptor may be placed on it; every other job is placed around it, or
    waits (`WaitingForReservation`) when the held capacity is the only place it fits now.
    """
    result = CycleResult()
    holds = [h for h in holds if h.until > now]
    timeline = (list(timeline) if timeline is not None
                else sorted([(r.expected_end, r.job_id) for r in running]))
    reservations: list[Reservation] = []
    strict_block: Reservation | None = None
    around_holds = _AroundHolds(holds)
    for pj in pending:
        spec = pj.spec
        if state.holds(spec.job_id):
            continue  # already running: nothing to decide
        if strict_block is not None:
            result.unplaceable.append(Unplaceable(
                spec.job_id, Reason.WAITING_FOR_RESERVATION,
                f"queued behind {strict_block.job_id}, planned to start at {human_time(strict_block.start)} "
                "(backfill is off)"))
            continue
        got = _place(state, pj)
        # The capacity held for other jobs' preemptions: this job goes around it (its own holds are its to use).
        others = [h for h in holds if h.preemptor != spec.job_id] if holds else []
        if isinstance(got, Placement) and others:
            around = around_holds.place(state, pj, got, others)
            if isinstance(around, Unplaceable):
                result.unplaceable.append(around)
                continue
            got = around
        if isinstance(got, Placement):
            end = now + spec.max_runtime_s
            # Only reservations that start before this job would end can be delayed by it.
            in_the_way = [r for r in reservations if r.start < end]
            if in_the_way and not _disjoint(got, [r.placement for r in in_the_way]):
                retry = place_job(state, spec, pj.allowed_models,
                                  exclusions_for([*(r.placement for r in in_the_way),
                                                  *(h.placement for h in others)]))
                if not isinstance(retry, Placement):
                    first = min(in_the_way, key=lambda r: (r.start, r.job_id))
                    result.unplaceable.append(Unplaceable(
                        spec.job_id, Reason.WAITING_FOR_RESERVATION,
                        f"fits now but would run until {human_time(end)} on capacity reserved for {first.job_id} "
                        f"from {human_time(first.start)} ({first.placement.gpus + first.placement.mig_slices} "
                        "GPUs/slices); waiting so as not to delay it"))
                    continue
                got = retry
            state.commit(got)
            around_holds.committed()
            result.placed.append(got)
            timeline.append((end, spec.job_id))
            continue
        if len(reservations) < max_reservations and got.reason not in _STATIC:
            slot = _earliest_slot(state, pj, timeline, reservations, now)
            if slot is not None:
                reservations.append(slot)
                result.reservations[spec.job_id] = slot.start
                got = Unplaceable(got.job_id, got.reason,
                                  f"{got.message}; reserved to start at {human_time(slot.start)}")
                if not backfill:
                    strict_block = slot
        result.unplaceable.append(got)
    return result


class _AroundHolds:
    """Places a cycle's jobs around the capacity held for other jobs' preemptions (a job's own holds are its to
    use), or says it waits for them."""

    def __init__(self, holds: Sequence[Hold]) -> None:
        self._holds = holds
        self._every_hold: dict[str, Exclusion] | None = None  # exclusions_for(every hold): most jobs preempt nobody
        # gang shapes (`placement_shape`) that fit only on held capacity, until the next commit: a backlog of one
        # shape is placed around every hold once, not once per job
        self._held_only: set[tuple[object, ...]] = set()

    def committed(self) -> None:
        """A job was placed: what fitted only on held capacity may fit elsewhere no more, or again: try again."""
        self._held_only.clear()

    def place(self, state: ClusterIndex, pj: PendingJob, got: Placement, others: list[Hold]) -> Placement | Unplaceable:
        """`got`, if it touches none of `others` (the holds not `pj`'s own); else a placement around them, or why
        `pj` waits."""
        if _disjoint(got, [h.placement for h in others]):
            return got
        spec = pj.spec
        shape: tuple[object, ...] | None = None
        if len(others) == len(self._holds):
            if self._every_hold is None:
                self._every_hold = exclusions_for(h.placement for h in self._holds)
            excluded = self._every_hold
            shape = (placement_shape(spec), pj.allowed_models, state.strategy_for(spec.queue))
        else:
            excluded = exclusions_for(h.placement for h in others)
        around: Placement | Unplaceable | None = None
        if shape is None or shape not in self._held_only:
            around = place_job(state, spec, pj.allowed_models, excluded)
            if shape is not None and not isinstance(around, Placement):
                self._held_only.add(shape)
        if isinstance(around, Placement):
            return around
        hold = min(others, key=lambda h: (h.until, h.preemptor, h.victim))
        return Unplaceable(
            spec.job_id, Reason.WAITING_FOR_RESERVATION,
            f"fits now only on {hold.words()} "
            f"(held until {human_time(hold.until)} at the latest)")


_PlaceMemo = tuple[JobSpec, Placement | Unplaceable]  # (the spec it was asked for, the answer)
# (spec, timeline, earlier reservations, the instant and placement found or None)
_SlotMemo = tuple[JobSpec, list[tuple[float, str]], tuple[Reservation, ...], tuple[float, Placement] | None]


def _place(state: ClusterIndex, pj: PendingJob) -> Placement | Unplaceable:
    """`place_job` without exclusions, remembered on the state until it changes: per job, and a refusal also
    per gang shape (`placement_shape`: everything of the spec the placer and its diagnosis read but the job id,
    which they only write into the answer), so a backlog of jobs of one shape costs one attempt per state."""
    spec = pj.spec
    key = ("place", spec.job_id, pj.allowed_models)
    hit = state.state_memo(key)
    if hit is not MISSING:
        seen, got = cast(_PlaceMemo, hit)
        if seen is spec or seen == spec:
            return got
    shape = ("refused", placement_shape(spec), pj.allowed_models, state.strategy_for(spec.queue))
    refused = state.state_memo(shape)
    if refused is not MISSING:
        same = cast(Unplaceable, refused)
        got = Unplaceable(spec.job_id, same.reason, same.message)
    else:
        got = place_job(state, spec, pj.allowed_models)
        if isinstance(got, Unplaceable):
            state.remember(shape, got)
    memo: _PlaceMemo = (spec, got)
    state.remember(key, memo)
    return got


def _earliest_slot(state: ClusterIndex, pj: PendingJob, timeline: list[tuple[float, str]],
                   earlier: Sequence[Reservation], now: float) -> Reservation | None:
    """`earliest_slot`, its search remembered on the state until it changes, with the timeline and earlier
    reservations it read (compared whole: equal inputs, equal answer)."""
    spec = pj.spec
    key = ("slot", spec.job_id, pj.allowed_models)
    hit = state.state_memo(key)
    found: tuple[float, Placement] | None
    if hit is not MISSING and _same_search(cast(_SlotMemo, hit), spec, timeline, earlier):
        found = cast(_SlotMemo, hit)[3]
    else:
        found = earliest_instant(state, pj, timeline, earlier)
        memo: _SlotMemo = (spec, list(timeline), tuple(earlier), found)
        state.remember(key, memo)
    if found is None:
        return None
    t, placement = found
    start = max(now, t)
    return Reservation(spec.job_id, start, start + spec.max_runtime_s, placement)


def _same_search(memo: _SlotMemo, spec: JobSpec, timeline: list[tuple[float, str]],
                 earlier: Sequence[Reservation]) -> bool:
    seen, seen_timeline, seen_earlier, _found = memo
    return (seen is spec or seen == spec) and seen_earlier == tuple(earlier) and seen_timeline == timeline


def _disjoint(p: Placement, others: Sequence[Placement]) -> bool:
    """True when the placement shares no node with any of the others (reservations, holds: the fast, common
    case)."""
    nodes = {b.node for b in p.bindings}
    return not any(b.node in nodes for o in others for b in o.bindings)


__all__ = ["Reservation", "earliest_slot", "schedule_cycle"]
