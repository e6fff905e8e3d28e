"""Seeded synthesis of what real traces lack: the user's runtime estimate and a priority class.

Every rule draws from a generator seeded by (seed, job_id) only, so the value of a job never depends on
which other jobs are in the window, on iteration order or on the policy: every policy sees the same
estimates and classes. The schedulers see the estimate, never the true duration.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

# Limits users actually type: 10 min, 30 min, 1-4-8-12 h, 1-2-3 days, 1-2 weeks; beyond, whole weeks.
RUNTIME_BUCKETS_S: tuple[int, ...] = (
    600, 1_800, 3_600, 7_200, 14_400, 28_800, 43_200, 86_400, 172_800, 259_200, 604_800, 1_209_600,
)
WEEK_S = 604_800

# Users over-estimate on average (noise mean e^(0.4+0.6²/2) ≈ 1.8, then rounded up to a bucket: median
# estimate ≈ 2.7× duration on Philly) and under-estimate sometimes (≈ 8% of Philly jobs overrun).
ESTIMATE_LOG_MEAN = 0.4
ESTIMATE_LOG_SIGMA = 0.6

# Priority mix for traces without one: 5% high, 75% normal, 20% low (best-effort sweeps).
PRIORITY_MIX: tuple[tuple[str, float], ...] = (("high", 0.05), ("normal", 0.80), ("low", 1.0))


# The rules below are pure functions of their arguments, kept for the jobs last asked: `--load` loads the window
# again at each scale it tries, and seeding a generator (SHA-512 of the seed string) per job and rule was half
# of loading it.
_CACHED = 1 << 18


def job_rng(seed: int, job_id: str, purpose: str) -> random.Random:
    # String seeds hash with SHA-512 inside `random`: stable across runs and Python processes.
    return random.Random(f"{seed}:{purpose}:{job_id}")


def round_up_to_bucket(seconds: float) -> int:
    for b in RUNTIME_BUCKETS_S:
        if seconds <= b:
            return b
    return math.ceil(seconds / WEEK_S) * WEEK_S


@lru_cache(maxsize=_CACHED)
def estimate_runtime(duration: int, job_id: str, seed: int) -> int:
    """estimate = duration × lognormal(0.4, 0.6) noise, rounded up to the next bucket a user would type."""
    noise = job_rng(seed, job_id, "estimate").lognormvariate(ESTIMATE_LOG_MEAN, ESTIMATE_LOG_SIGMA)
    return round_up_to_bucket(max(1.0, duration * noise))


@lru_cache(maxsize=_CACHED)
def priority_class(job_id: str, seed: int) -> str:
    u = job_rng(seed, job_id, "priority").random()
    for name, upper in PRIORITY_MIX:
        if u < upper:
            return name
    return PRIORITY_MIX[-1][0]


# Checkpoint support for traces without it: most training frameworks checkpoint periodically; a minority of
# jobs (quick experiments, scripts without a resume path) do not. Same rule for every policy.
CHECKPOINT_SUPPORT_SHARE = 0.85
CHECKPOINT_INTERVAL_S = 1_800


@lru_cache(maxsize=_CACHED)
def checkpoint_interval(job_id: str, seed: int) -> int | None:
    """The job's checkpoint interval, or None when it cannot checkpoint (seeded per job)."""
    return CHECKPOINT_INTERVAL_S if job_rng(seed, job_id, "checkpoint").random() < CHECKPOINT_SUPPORT_SHARE else None
