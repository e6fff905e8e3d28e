"""Hops per preemption, followed by ids over an event history (services/core/preemption/hops.py)."""

from __future__ import annotations

from typing import Any

from services.core.preemption import preemption_chains


def ev(kind: str, t: int, event_id: str = "", **data: Any) -> dict[str, Any]:
    return {"type": f"io.gpuq.{kind}.v1", "id": event_id or f"{kind}-{t}", "time": f"2026-01-01T00:00:{t:02d}Z",
            "data": data}


def test_reclaim_with_checkpoint_and_a_priority_preemption_without_one() -> None:
    history = [
        ev("job.placed", 1, job_id="b"),  # the preemptor's placement before the preemption is not on the chain
        ev("preemption.requested", 2, "req-1", preemptor="b"),
        ev("job.checkpoint_requested", 3, job_id="a", preemption_id="req-1"),
        ev("job.checkpointed", 5, job_id="a", preemption_id="req-1"),
        ev("job.preempted", 6, job_id="a", preemption_id="req-1", preemptor="b"),
        ev("job.admitted", 7, job_id="b"),
        ev("job.placed", 8, job_id="b"),
        # a deferred request re-run under `<id>/retry-1`; a victim that cannot checkpoint; no re-admission
        ev("preemption.requested", 10, "req-2", preemptor="p"),
        ev("job.preempted", 20, job_id="v", preemption_id="req-2/retry-1", preemptor="p"),
        ev("job.placed", 21, job_id="p"),
    ]
    a, v = preemption_chains(reversed(history))  # by ids and times, not arrival order
    assert (a.victim, a.preemptor, a.hops) == ("a", "b", 6)
    assert a.steps == ("preemption.requested", "job.checkpoint_requested", "job.checkpointed", "job.preempted",
                       "job.admitted", "job.placed")
    assert (v.victim, v.steps) == ("v", ("preemption.requested", "job.preempted", "job.placed"))
