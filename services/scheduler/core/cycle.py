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
"""

from __future__ import annotations

from collections.abc import Sequence

from .index import ClusterIndex
from .placer import place_job
from .slot import Reservation, earliest_slot
from .staging import exclusions_for
from .types import CycleResult, PendingJob, Placement, Reason, RunningJob, Unplaceable

# Reasons that releasing running jobs cannot cure: no reservation is searched for them.
_STATIC = {Reason.NO_GPU_MODEL, Reason.UNTOLERATED, Reason.NO_READY_NODES}


def schedule_cycle(state: ClusterIndex, pending: Sequence[PendingJob], running: Sequence[RunningJob], now: float,
                   *, backfill: bool = True, max_reservations: int = 1) -> CycleResult:
    """Place what can start now, reserve for blocked heads, backfill around the reservations.

    Commits every placed job into `state` (pass `state.copy()` for a dry run).
    """
    result = CycleResult()
    timeline: list[tuple[float, str]] = sorted((r.expected_end, r.job_id) for r in running)
    reservations: list[Reservation] = []
    strict_block: Reservation | None = None
    for pj in pending:
        spec = pj.spec
        if state.holds(spec.job_id):
            continue  # already running: nothing to decide
        if strict_block is not None:
            result.unplaceable.append(Unplaceable(
                spec.job_id, Reason.WAITING_FOR_RESERVATION,
                f"queued behind {strict_block.job_id}, planned to start at t={strict_block.start:.0f} "
                "(backfill is off)"))
            continue
        got = place_job(state, spec, pj.allowed_models)
        if isinstance(got, Placement):
            end = now + spec.max_runtime_s
            # Only reservations that start before this job would end can be delayed by it.
            in_the_way = [r for r in reservations if r.start < end]
            if in_the_way and not _disjoint(got, in_the_way):
                retry = place_job(state, spec, pj.allowed_models, exclusions_for(r.placement for r in in_the_way))
                if not isinstance(retry, Placement):
                    first = min(in_the_way, key=lambda r: (r.start, r.job_id))
                    result.unplaceable.append(Unplaceable(
                        spec.job_id, Reason.WAITING_FOR_RESERVATION,
                        f"fits now but would run until t={end:.0f} on capacity reserved for {first.job_id} "
                        f"from t={first.start:.0f} ({first.placement.gpus + first.placement.mig_slices} "
                        "GPUs/slices); waiting so as not to delay it"))
                    continue
                got = retry
            state.commit(got)
            result.placed.append(got)
            timeline.append((end, spec.job_id))
            continue
        if len(reservations) < max_reservations and got.reason not in _STATIC:
            slot = earliest_slot(state, pj, timeline, reservations, now)
            if slot is not None:
                reservations.append(slot)
                result.reservations[spec.job_id] = slot.start
                got = Unplaceable(got.job_id, got.reason,
                                  f"{got.message}; reserved to start at t={slot.start:.0f}")
                if not backfill:
                    strict_block = slot
        result.unplaceable.append(got)
    return result


def _disjoint(p: Placement, reservations: Sequence[Reservation]) -> bool:
    """True when the placement shares no node with any of the reservations (the fast, common case)."""
    nodes = {b.node for b in p.bindings}
    return not any(b.node in nodes for r in reservations for b in r.placement.bindings)


__all__ = ["Reservation", "earliest_slot", "schedule_cycle"]
