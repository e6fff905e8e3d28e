"""The preemption service's pure core: victim rules, victim selection, guard rails.

No I/O, no clock, no asyncio: callers pass `now` and snapshots. The service (services/preemption/app.py)
and the ETA's replay and the simulator (services/core/eta/preemption.py) drive the same functions.
"""

from .drain import DrainPlan, drain_plan
from .guards import cooldown_ends, cooldown_s, cooldown_verdict, rate_limit_verdict
from .hops import PreemptionChain, preemption_chains
from .model import PRIORITY, RECLAIM, Outcome, Preemptor, RunningJob, Selection, Why, priority_of, usage_by_queue
from .policy import class_verdict, is_borrowing, needed_resources, protection, protection_ends, victim_verdict
from .select import candidate_key, select_victims, set_key

__all__ = [
    "PRIORITY",
    "RECLAIM",
    "DrainPlan",
    "Outcome",
    "PreemptionChain",
    "Preemptor",
    "RunningJob",
    "Selection",
    "Why",
    "candidate_key",
    "class_verdict",
    "cooldown_ends",
    "cooldown_s",
    "cooldown_verdict",
    "drain_plan",
    "is_borrowing",
    "needed_resources",
    "preemption_chains",
    "priority_of",
    "protection",
    "protection_ends",
    "rate_limit_verdict",
    "select_victims",
    "set_key",
    "usage_by_queue",
    "victim_verdict",
]
