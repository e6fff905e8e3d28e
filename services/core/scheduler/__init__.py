"""The scheduler's pure placement core: cluster index, gang placement, topology, scoring, backfill.

No I/O, no clock, no asyncio: callers pass `now` and a snapshot and get a decision back. The NATS service
(services/scheduler/app.py), the pipeline core and the simulator drive the same functions. This package's
public API is what this module exports; modules inside it import one way only:

    types <- index <- staging <- diagnose <- placer <- state, slot, elastic <- cycle, fragmentation
"""

from .cycle import Reservation, earliest_slot, schedule_cycle
from .elastic import can_grow, grow_one, place_now, pods_by_set, restore, shrink_to
from .fragmentation import fragmentation, fragmented_gpus
from .index import ClusterIndex, IndexedNode, NodeClass
from .slot import may_fit_if_released
from .state import STRATEGIES, ClusterState
from .types import (
    CycleResult,
    Hold,
    PendingJob,
    Placement,
    PlacementConflict,
    Reason,
    RunningJob,
    Unplaceable,
)

__all__ = [
    "STRATEGIES",
    "ClusterIndex",
    "ClusterState",
    "CycleResult",
    "Hold",
    "IndexedNode",
    "NodeClass",
    "PendingJob",
    "Placement",
    "PlacementConflict",
    "Reason",
    "Reservation",
    "RunningJob",
    "Unplaceable",
    "can_grow",
    "earliest_slot",
    "fragmentation",
    "fragmented_gpus",
    "grow_one",
    "may_fit_if_released",
    "place_now",
    "pods_by_set",
    "restore",
    "schedule_cycle",
    "shrink_to",
]
