"""Per-queue summary for `gpuq queues`: nominal, used, borrowed, lent, pending, running, oldest wait."""

from __future__ import annotations

from collections.abc import Iterable

from services.core.admission.model import QueueFacts, QueueSummary
from services.core.admission.quota import QuotaBook
from services.core.admission.state import AdmissionState


def queue_summaries(state: AdmissionState, now: float) -> list[QueueSummary]:
    """One row per configured queue, sorted by name."""
    return [facts.at(now) for facts in queue_facts(state)]


def queue_facts(state: AdmissionState, queues: Iterable[str] | None = None) -> list[QueueFacts]:
    """One row per configured queue, sorted by name, as of no particular time (what admission publishes). Given
    `queues` (those `AdmissionState.take_touched` names), only theirs and their lending pools' (a queue's lent share
    moves with its pool's borrowing), each walking its own queue's jobs instead of every pending job."""
    book = state.book
    lent = _lent(book)
    if queues is None:
        pending: dict[str, list[float]] = {}
        inadmissible: dict[str, int] = {}
        for w in state.pending.values():
            pending.setdefault(w.spec.queue, []).append(w.submitted_at)
            if state.inadmissible(w.spec.job_id) is not None:
                inadmissible[w.spec.queue] = inadmissible.get(w.spec.queue, 0) + 1
        return [_facts(state, book, lent, q, (len(pending.get(q, ())), inadmissible.get(q, 0),
                                              min(pending[q]) if q in pending else None))
                for q in sorted(book.queues)]
    wanted: set[str] = set()
    for q in queues:
        qq = book.queues.get(q)
        if qq is not None:
            wanted.update(book.pool_members.get(qq.pool, (q,)) if qq.pool is not None else (q,))
    return [_facts(state, book, lent, q, state.waiting(q)) for q in sorted(wanted)]


def _facts(state: AdmissionState, book: QuotaBook, lent: dict[str, dict[str, int]], q: str,
           waiting: tuple[int, int, float | None]) -> QueueFacts:
    qq = book.queues[q]
    count, inadmissible, oldest = waiting
    return QueueFacts(
        queue=q,
        cohort=qq.cohort,
        weight=qq.weight,
        strategy=qq.config.queueing_strategy.value,
        nominal=dict(sorted(qq.nominal.items())),
        used=state.usage(q),
        borrowed=state.borrowed(q),
        lent={r: v for r, v in sorted(lent.get(q, {}).items()) if v},
        pending=count,
        inadmissible=inadmissible,
        running=book.running.get(q, 0),
        max_running_jobs=qq.max_running,
        oldest_submitted_at=oldest,
    )


def _lent(book: QuotaBook) -> dict[str, dict[str, int]]:
    """A flat cohort pools lendable quota, so who lent to whom is a convention: the cohort's total borrowing
    per resource is attributed to the lenders in proportion to their unused lendable quota (largest remainder,
    ties by queue name), integers only."""
    out: dict[str, dict[str, int]] = {}
    for members in (book.pool_members[c] for c in sorted(book.pool_members)):  # a cohort tree pools
        resources = sorted({r for q in members for r in book.queues[q].nominal})
        for r in resources:
            borrowed = sum(book.borrowed(q, r) for q in members)
            if borrowed <= 0:
                continue
            unused = {}
            for q in members:
                qq = book.queues[q]
                n = qq.nominal.get(r, 0)
                lendable = n - qq.guaranteed.get(r, 0)
                unused[q] = max(0, min(lendable, n - book.used(q, r)))
            pool = sum(unused.values())
            if pool <= 0:
                continue
            borrowed = min(borrowed, pool)
            shares = {q: borrowed * u // pool for q, u in unused.items()}
            left = borrowed - sum(shares.values())
            by_remainder = sorted(unused, key=lambda q: (-(borrowed * unused[q] % pool), q))
            for q in by_remainder[:left]:
                shares[q] += 1
            for q, v in shares.items():
                if v:
                    out.setdefault(q, {})[r] = v
    return out
