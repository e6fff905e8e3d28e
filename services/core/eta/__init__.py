"""The ETA's pure core: forward simulation with the production pipeline and preemption cores (eta.py) and the
driver of the preemption core that the replay and the simulator share (preemption.py).

No I/O, no clock, no randomness: callers pass `now` and snapshots, and keep the memory (`EtaModel`).
"""

from .eta import (
    ALL_QUEUES,
    DEFAULT_BUDGET,
    DEFAULT_HORIZON_S,
    ETA_MIN_REFRESH_S,
    ETA_REFRESH_S,
    IDLE_REFRESH_S,
    Arrival,
    ArrivalHistory,
    EtaCalibration,
    EtaModel,
    EtaRange,
    ReplayPreemption,
    RunningView,
    conformal_quantile,
    estimate_ranges,
    estimate_starts,
    gpu_share,
    plan_starts,
    refresh_due,
    replay_reserved,
    waiting_queues,
)
from .preemption import Preempted, PreemptionContext, PreemptionHook, RunningInfo, SimPreemption

__all__ = [
    "ALL_QUEUES",
    "DEFAULT_BUDGET",
    "DEFAULT_HORIZON_S",
    "ETA_MIN_REFRESH_S",
    "ETA_REFRESH_S",
    "IDLE_REFRESH_S",
    "Arrival",
    "ArrivalHistory",
    "EtaCalibration",
    "EtaModel",
    "EtaRange",
    "Preempted",
    "PreemptionContext",
    "PreemptionHook",
    "ReplayPreemption",
    "RunningInfo",
    "RunningView",
    "SimPreemption",
    "conformal_quantile",
    "estimate_ranges",
    "estimate_starts",
    "gpu_share",
    "plan_starts",
    "refresh_due",
    "replay_reserved",
    "waiting_queues",
]
