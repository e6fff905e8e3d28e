"""Admission's pure core: team queues, cohorts, quotas with borrowing and lending limits, fair share,
priorities, StrictFIFO/BestEffortFIFO, reclaim requests, and a reason for every pending job.

No asyncio, no I/O, no clock reads: callers pass `now`. Same input, same output.
"""

from services.core.admission.cycle import admission_cycle
from services.core.admission.elastic import (
    above_floor,
    charge_running,
    cohort_waits,
    growth_room,
    over_nominal,
    queue_waits,
    quota_keys,
)
from services.core.admission.model import (
    AdmissionDecision,
    AdmittedWorkload,
    PendingStatus,
    QueueFacts,
    QueueSummary,
    Reason,
    ReclaimRequest,
    Rejection,
    Workload,
)
from services.core.admission.state import AdmissionState
from services.core.admission.summary import queue_facts, queue_summaries

__all__ = [
    "AdmissionDecision",
    "AdmissionState",
    "AdmittedWorkload",
    "PendingStatus",
    "QueueFacts",
    "QueueSummary",
    "Reason",
    "ReclaimRequest",
    "Rejection",
    "Workload",
    "above_floor",
    "admission_cycle",
    "charge_running",
    "cohort_waits",
    "growth_room",
    "over_nominal",
    "queue_facts",
    "queue_summaries",
    "queue_waits",
    "quota_keys",
]
