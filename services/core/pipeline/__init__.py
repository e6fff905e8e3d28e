"""The one admission→placement pipeline core: what happens to a job between "submitted" and "placed".

It owns, for every caller alike (the admission and scheduler services, the simulator's `gpuq` policy, the ETA
forward simulation):

1. the capacity rule between admission and placement: admission reserves *quota* only; physical capacity is
   placement's (`admit`). Admission is never capped by the free GPUs it believes in: that belief is the
   scheduler's fact, and a cap hid admitted higher-priority work from the preemption rule below;
2. the order in which admitted jobs are placed: priority, then admission time, then id
   (`placement_key`);
3. when a job asks for preemption: an admitted job that cannot be placed for want of capacity (not for a
   static reason no victim can cure) while a running preemptible job of strictly lower priority exists
   (`asks_for_preemption`).

`decide` (loop.py) is the one decision loop: on one snapshot it admits, places in order and, in the same pass,
chooses the victims for the jobs found unplaceable for a curable reason and for admission's reclaims
(`choose_victims`, preempt.py: the preemption core's rules and guard rails), returning one `Decision`. The
simulator and the ETA's replay call it; the preemption service chooses each request's victims with the same
`choose_victims`. `cycle` is its admit-and-place half; the services run its two halves on their own events
(admission's `admit`, the scheduler's `place_ordered` over a `PlacementBook`, which keeps the order and the
running timeline event by event). Pure: no I/O, no clock; the rules of admission (quota, borrowing, fair share)
stay in the admission core, those of placement (gang, topology, backfill) in the scheduler core, and they plug
in here unchanged.
"""

from .book import BookView, PlacementBook
from .loop import Decision, PreemptionStage, ReplayAsks, ServiceAsks, decide
from .pipeline import (
    MIN_HOLD_S,
    CycleOutcome,
    PlacementOutcome,
    WaitingJob,
    admit,
    asks_for_preemption,
    cycle,
    hold_until,
    place,
    place_ordered,
    placement_key,
    priority_value,
    waiting_job,
)
from .preempt import (
    Choice,
    Preempted,
    PreemptionContext,
    PreemptionHook,
    RunningInfo,
    VictimChooser,
    choose_victims,
)
from .retry import RetryDecision, decide_retry, retry_delay_s

__all__ = [
    "MIN_HOLD_S",
    "BookView",
    "Choice",
    "CycleOutcome",
    "Decision",
    "PlacementBook",
    "PlacementOutcome",
    "Preempted",
    "PreemptionContext",
    "PreemptionHook",
    "PreemptionStage",
    "ReplayAsks",
    "RetryDecision",
    "RunningInfo",
    "ServiceAsks",
    "VictimChooser",
    "WaitingJob",
    "admit",
    "asks_for_preemption",
    "choose_victims",
    "cycle",
    "decide",
    "decide_retry",
    "hold_until",
    "place",
    "place_ordered",
    "placement_key",
    "priority_value",
    "retry_delay_s",
    "waiting_job",
]
