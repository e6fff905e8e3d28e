"""Fair share over time: a queue's standing counts what it borrowed in the past, not only what it borrows now
(Slurm's PriorityDecayHalfLife, KAI's time-aware fairness, Kueue's admission fair sharing).

The caller hands in, per queue and quota resource, its usage in GPU-seconds decayed with a half-life H (each
GPU-second used `a` seconds ago counts 2^(−a/H)), read from the metering ledger's history (the simulator feeds
the same history from the runs it replays). Dividing by the decay's mean lifetime τ = H / ln 2 gives the
queue's average use, in GPUs, over the recent past. The part above its nominal quota is what it borrowed on
average, and it is scored exactly as the admission cycle scores current borrowing (QuotaBook.share: borrowed ×
flavor weight × 1000 ÷ the cohort's lendable quota, the largest resource, ÷ queue weight). The cycle orders
queues by current share + historic share: a queue that borrowed heavily last week waits behind one that did
not, at equal priority, and the memory fades with the half-life. Without history the term is 0 (Kueue's order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from services.core.admission.quota import QueueQuota, QuotaBook
from services.core.admission.resources import base_model


def historic_share(book: QuotaBook, qq: QueueQuota, decayed_gpu_s: Mapping[str, float], half_life_s: float) -> float:
    """The queue's historic borrowing score (same scale as QuotaBook.share); 0 without a cohort or history."""
    if qq.cohort is None or half_life_s <= 0 or not decayed_gpu_s:
        return 0.0
    tau = half_life_s / math.log(2)
    lendable = book.share_pool[qq.cohort]
    score = 0.0
    for r in sorted(decayed_gpu_s):
        borrowed = decayed_gpu_s[r] / tau - qq.nominal.get(r, 0)
        if borrowed <= 0:
            continue
        pool = lendable.get(r, 0)
        score = max(score, borrowed * book.flavor_weight.get(base_model(r), 1.0) * 1000 / (pool if pool > 0 else 1))
    if score == 0.0:
        return 0.0
    return score / qq.weight if qq.weight > 0 else math.inf


def historic_shares(book: QuotaBook, decayed_gpu_s: Mapping[str, Mapping[str, float]],
                    half_life_s: float) -> dict[str, float]:
    """Per queue of `book` with a non-zero score, its `historic_share` from its decayed usage per resource."""
    if half_life_s <= 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
    shares = {}
    for q in sorted(decayed_gpu_s):
        qq = book.queues.get(q)
        if qq is not None:
            v = historic_share(book, qq, decayed_gpu_s[q], half_life_s)
            if v:
                shares[q] = v
    return shares
