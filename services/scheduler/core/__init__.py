"""The scheduler's pure placement core: cluster snapshot, gang placement, topology, scoring, backfill.

No I/O, no clock, no asyncio: callers pass `now` and a snapshot and get a decision back. The NATS service
(services/scheduler/app.py) and the simulator drive the same functions.
"""

from .cycle import Reservation, earliest_slot, schedule_cycle
from .fragmentation import fragmentation
from .state import STRATEGIES, ClusterState
from .types import (
    CycleResult,
    PendingJob,
    Placement,
    PlacementConflict,
    Reason,
    RunningJob,
    Unplaceable,
)

__all__ = [
    "STRATEGIES",
    "ClusterState",
    "CycleResult",
    "PendingJob",
    "Placement",
    "PlacementConflict",
    "Reason",
    "Reservation",
    "RunningJob",
    "Unplaceable",
    "earliest_slot",
    "fragmentation",
    "schedule_cycle",
]
