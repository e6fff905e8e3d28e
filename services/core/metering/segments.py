"""Allocation segments of one job, derived from the set of its lifecycle facts.

A job is allocated GPUs from each placement until the first end fact at or after it (completed, failed,
cancelled, preempted) — or until its next placement, if the end was never reported. A placement made after the
job was already over (its cancel, completion or final failure stamped before the placement: a cancel that
admission decided while the scheduler was placing the job) ends at its own instant: nothing later will ever end
it, and the job was over before it got the GPUs, so it is charged nothing (the scheduler frees them when it hears
the end; no fact says when). The result depends only on the *set* of facts, never on the order they arrived in, so
a redelivered, duplicated or shuffled event stream yields the same segments: the store keeps the facts and
rebuilds a job's segments from all of them each time one is added.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from services.core.metering.units import split_lost


class FactKind(StrEnum):
    PLACED = "placed"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    RESIZED = "resized"  # an elastic job grown or shrunk while it runs (JobResized): a new placement, no end


END_KINDS = (FactKind.COMPLETED, FactKind.FAILED, FactKind.CANCELLED, FactKind.PREEMPTED)
# When two end facts carry the same instant, the more specific explanation wins (deterministically).
_END_RANK = {FactKind.PREEMPTED: 0, FactKind.FAILED: 1, FactKind.CANCELLED: 2, FactKind.COMPLETED: 3}


@dataclass(frozen=True)
class Fact:
    kind: FactKind
    at_ms: int
    shares: tuple[tuple[str, int], ...] = ()  # PLACED, RESIZED: (node, milli-GPUs) sorted by node
    model_hint: str | None = None  # PLACED, RESIZED: the only GPU model the spec allows, if any
    lost_ms: int = 0  # PREEMPTED: GPU-milliseconds of work lost since the last checkpoint
    retried: bool = False  # FAILED: a failed attempt the job's retry policy retries (JobAttemptFailed), not its end

    @property
    def ends_job(self) -> bool:
        """The job's own end (completed, cancelled, failed for good): no placement after it is ever ended by
        another fact."""
        return self.kind in (FactKind.COMPLETED, FactKind.CANCELLED) or (
            self.kind is FactKind.FAILED and not self.retried)


@dataclass(frozen=True)
class AllocationPart:
    """One node's share of one segment: the row the store writes into `metering.allocations`."""

    placed_at_ms: int
    node: str  # "" for a preemption with no known placement (lost work only)
    milli_gpus: int
    model_hint: str | None
    started_at_ms: int | None
    ended_at_ms: int | None  # None = still allocated
    # a FactKind value; "replaced" when the job was placed again without an end, "resized" when it runs on in the
    # next segment with another number of pods (an elastic job's resize)
    end_kind: str | None
    lost_ms: int


def build_segments(facts: list[Fact] | tuple[Fact, ...]) -> list[AllocationPart]:
    """Every allocation part of one job, sorted by (placed_at, node)."""
    # One fact per (kind, instant), as the store's key has it; should two disagree, the first in a total
    # order wins, so the choice never depends on arrival order.
    by_key: dict[tuple[FactKind, int], Fact] = {}
    for f in sorted(set(facts), key=lambda f: (f.at_ms, f.kind.value, f.shares, f.model_hint or "", f.lost_ms,
                                               f.retried)):
        by_key.setdefault((f.kind, f.at_ms), f)
    unique = list(by_key.values())
    # a resize is a placement that ends none of the job's run: the segment before it closes there as "resized",
    # and the new one is started when that one was (a placement and a resize at one instant: the placement)
    placements: dict[int, Fact] = {}
    for f in unique:
        if f.kind in (FactKind.PLACED, FactKind.RESIZED):
            placements.setdefault(f.at_ms, f)
    starts = sorted(f.at_ms for f in unique if f.kind is FactKind.STARTED)
    ends = sorted((f for f in unique if f.kind in END_KINDS), key=lambda f: (f.at_ms, _END_RANK[f.kind]))
    job_ends = [e for e in ends if e.ends_job]
    ordered = sorted(placements)
    parts: list[AllocationPart] = []
    used_preemptions: set[int] = set()
    consumed: set[Fact] = set()  # an end at the instant of the next placement ends the earlier one only
    running_on = False  # the segment before ran until a resize
    for i, placed_at in enumerate(ordered):
        placement = placements[placed_at]
        next_at = ordered[i + 1] if i + 1 < len(ordered) else None
        end = next((e for e in ends if e.at_ms >= placed_at and (next_at is None or e.at_ms <= next_at)
                    and e not in consumed), None)
        if end is not None:
            consumed.add(end)
        over = next((e for e in reversed(job_ends) if e.at_ms <= placed_at), None) if end is None else None
        if end is not None:
            ended_at, end_kind = end.at_ms, end.kind.value
        elif over is not None:  # placed after the job's end (a cancel that raced the placement): charged nothing
            ended_at, end_kind = placed_at, over.kind.value
        elif next_at is not None:
            ended_at, end_kind = next_at, "resized" if placements[next_at].kind is FactKind.RESIZED else "replaced"
        else:
            ended_at, end_kind = None, None
        started = next((s for s in starts if s >= placed_at and (ended_at is None or s <= ended_at)), None)
        if running_on and placement.kind is FactKind.RESIZED:
            started = placed_at
        running_on = started is not None and end_kind == "resized"
        lost = end.lost_ms if end is not None and end.kind is FactKind.PREEMPTED else 0
        if end is not None and end.kind is FactKind.PREEMPTED:
            used_preemptions.add(end.at_ms)
        shares = placement.shares or (("", 0),)
        for (node, milli), lost_part in zip(shares, split_lost(lost, shares), strict=True):
            parts.append(AllocationPart(placed_at, node, milli, placement.model_hint, started, ended_at,
                                        end_kind, lost_part))
    # A preemption whose placement metering never saw still records the work it lost.
    for e in ends:
        if e.kind is FactKind.PREEMPTED and e.at_ms not in used_preemptions and e.lost_ms:
            parts.append(AllocationPart(e.at_ms, "", 0, None, None, e.at_ms, e.kind.value, e.lost_ms))
            used_preemptions.add(e.at_ms)
    return sorted(parts, key=lambda p: (p.placed_at_ms, p.node))
