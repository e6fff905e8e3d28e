"""Fair-sharing preemption (Kueue KEP-1714, pkg/scheduler/preemption/preemption.go `fairPreemptions`,
fairsharing/strategy.go), opt-in with `fair_sharing.preemption: true`.

A job that must borrow and finds too little lendable in its cohort tree may take the room from other queues'
borrowers when its queue, after admitting it, would not be above them in dominant resource share:

  * candidates: the reclaim candidates (admitted preemptible jobs of other queues of the tree that borrow a
    resource the job needs; `reclaim_within_cohort: LowerPriority` only strictly lower priority, `Any` any),
    less the victims this cycle's earlier requests already count on. A queue within its nominal quota has none:
    nominal quota is never a fair-sharing victim's loss.
  * the preemptor's share is taken with its job added (PreemptorNewShare). Repeatedly the borrowing queue with
    the highest share is taken (ties: the one whose next candidate comes first in candidate order), and its
    candidates are tried in order under the first strategy:
      LessThanOrEqualToFinalShare (rule S2-a): preemptor's new share <= the target's share without the victim;
      LessThanInitialShare (rule S2-b): preemptor's new share < the target's share before the victim goes.
    A passing victim is removed (simulated), and the target queue is chosen again; a failing one is kept for
    the second strategy, which, when configured, takes at most one victim per queue that passes rule S2-b.
  * the room stays with the preemptor: a victim is taken only when, with it (and the victims before it) gone,
    every job its queue would admit into the freed room (the victims requeued, its pending jobs of the
    preemptor's priority) puts that queue strictly above the preemptor's new share, so the admission order
    reaches the preemptor first. Rule S2-b alone compares with the target's share before the victim goes and
    can leave the target below the preemptor: the requeued victim was then admitted first (at an equal share
    its earlier submit time wins), borrowed the room back, and the same preemption repeated every cycle.
  * it stops as soon as the job fits; when the victims found cannot make it fit, nothing is asked.
  * the cycle asks after its admissions (one job per queue: its first that must borrow and did not fit), so
    the room the victims free is not also counted on by a job admitted later in the same cycle; and it takes
    no victim of higher priority than the preemptor even under `reclaim_within_cohort: Any`, because the
    admission order puts priority before the share: such a victim would take its room back at the next cycle.

Shares are what the admission order reads (`QuotaBook.share`, plus the historic share when usage history is
given): a zero-weight queue that borrows has +inf. Such a queue
never preempts by fair sharing (Kueue's fsStrategyUnsatisfiable for a target below +inf; between two zero-weight
borrowers Kueue compares their unweighted shares, but the admission order here ties them, so taking a victim
from one for the other would only hand the room back and forth). The simulation changes the live QuotaBook and
restores it exactly before returning (integers only), as Kueue simulates on its snapshot.

What differs from Kueue: shares are compared queue against queue with each queue's share computed against its own
cohort's potential pool (Kueue compares, in a cohort tree, the shares of the lowest common ancestor's children,
with cohort weights, and orders admissions the same way; the admission order here compares queues, and judging a
preemption by other shares than the order that then admits would hand the room back); the preemptor's own queue is
not a candidate here (its lower-priority jobs are taken by within-queue preemption, which has its own rules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from services.core.admission.quota import QueueQuota, QuotaBook
from shared.config import FairSharingStrategy

if TYPE_CHECKING:
    from services.core.admission.state import AdmissionState

INF = float("inf")


def share(book: QuotaBook, qq: QueueQuota, extra: Mapping[str, int] | None = None) -> float:
    """The queue's weighted dominant resource share (after admitting `extra`)."""
    return book.share(qq, extra or {})


def _standing(state: AdmissionState, qq: QueueQuota) -> float:
    """What the admission order reads: the share plus the historic share when the caller gave usage history
    (core/history.py). Preemption judges by the same number, or the victim's queue would be admitted first
    again and take the room back."""
    return state.book.share(qq, {}) + state.history_share(qq.name)


def fair_victims(state: AdmissionState, qq: QueueQuota, request: Mapping[str, int], candidates: Sequence[str],
                 strategies: Sequence[FairSharingStrategy],
                 comeback: Mapping[str, Sequence[Mapping[str, int]]] | None = None) -> tuple[str, ...]:
    """The victims, in the order chosen, whose removal lets `request` fit in `qq` under the strategies; () when
    they cannot make it fit. `candidates` in candidate order (lowest priority, most recently admitted, id).
    `comeback`: per queue, the requests of its pending jobs of the preemptor's priority (what it would admit
    into freed room); with the victims themselves they must stay behind the preemptor (`_stays_behind`)."""
    book = state.book
    by_queue: dict[str, list[str]] = {}
    rank = {job_id: i for i, job_id in enumerate(candidates)}
    for job_id in candidates:
        by_queue.setdefault(state.admitted[job_id].spec.queue, []).append(job_id)
    removed: list[tuple[str, Mapping[str, int]]] = []
    targets: list[str] = []
    returning: dict[str, dict[tuple[tuple[str, int], ...], Mapping[str, int]]] = {}
    for queue, usages in sorted((comeback or {}).items()):  # (a job asking for none of it takes no freed room)
        returning[queue] = {tuple(sorted(u.items())): u for u in usages if any(r in request for r in u)}
    preemptor_at: list[float] = []  # the preemptor's standing with its job admitted, once known

    def remove(job_id: str) -> None:
        a = state.admitted[job_id]
        book.add(a.spec.queue, a.usage, -1)
        removed.append((a.spec.queue, a.usage))
        targets.append(job_id)
        returning.setdefault(a.spec.queue, {})[tuple(sorted(a.usage.items()))] = a.usage

    def stays_behind(queue: str, victim: Mapping[str, int]) -> bool:
        """With `victim` removed too (the book as it is now less `victim`), every job the target queue would
        admit into the freed room (its victims requeued, its pending jobs of the preemptor's priority) puts it
        strictly above the preemptor's new standing, so the admission order reaches the preemptor first."""
        tq = book.queues[queue]
        usages = dict(returning.get(queue, {}))
        usages[tuple(sorted(victim.items()))] = victim
        book.add(queue, victim, -1)
        try:
            history = state.history_share(queue)
            return all(book.share(tq, u) + history > preemptor_at[0] for _k, u in sorted(usages.items()))
        finally:
            book.add(queue, victim)

    def fits() -> bool:
        book.add(qq.name, request, -1)  # the preemptor's own usage was added for the shares only
        try:
            return all(n <= book.available(qq, r) for r, n in request.items())
        finally:
            book.add(qq.name, request)

    book.add(qq.name, request)  # shares are taken with the preemptor's job admitted (PreemptorNewShare)
    try:
        preemptor_at.append(_standing(state, qq))
        if _first_strategy(state, qq, by_queue, rank, strategies[0], remove, fits, stays_behind):
            return tuple(targets)
        if len(strategies) > 1 and _second_strategy(state, qq, by_queue, rank, remove, fits, stays_behind):
            return tuple(targets)
        return ()
    finally:
        book.add(qq.name, request, -1)
        for queue, usage in reversed(removed):
            book.add(queue, usage)


def _next_queue(state: AdmissionState, by_queue: Mapping[str, list[str]], rank: Mapping[str, int],
                dropped: set[str]) -> str | None:
    """The borrowing queue with candidates left and the highest share (Kueue's target ordering)."""
    book = state.book
    best: tuple[float, int, str] | None = None
    for queue in sorted(by_queue):
        left = by_queue[queue]
        if queue in dropped or not left:
            continue
        tq = book.queues.get(queue)
        if tq is None:
            continue
        if book.share(tq, {}) == 0.0:  # no longer borrowing: its nominal quota is its own
            dropped.add(queue)
            continue
        key = (_standing(state, tq), -rank[left[0]], queue)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best is not None else None


def _first_strategy(state: AdmissionState, qq: QueueQuota, by_queue: dict[str, list[str]], rank: Mapping[str, int],
                    strategy: FairSharingStrategy, remove: Callable[[str], None], fits: Callable[[], bool],
                    stays_behind: Callable[[str, Mapping[str, int]], bool]) -> bool:
    book = state.book
    preemptor = _standing(state, qq)
    if preemptor == INF:
        return False
    dropped: set[str] = set()
    retry: dict[str, list[str]] = {}
    while (queue := _next_queue(state, by_queue, rank, dropped)) is not None:
        tq = book.queues[queue]
        old = _standing(state, tq)
        left = by_queue[queue]
        while left:
            job_id = left.pop(0)
            victim = state.admitted[job_id].usage
            if strategy is FairSharingStrategy.LESS_THAN_INITIAL_SHARE:
                passed = preemptor < old
            else:  # the target's share without this victim
                book.add(queue, victim, -1)
                new = _standing(state, tq)
                book.add(queue, victim)
                passed = preemptor <= new
            if passed and stays_behind(queue, victim):
                remove(job_id)
                if fits():
                    return True
                break  # shares changed: choose the target queue again
            retry.setdefault(queue, []).append(job_id)
    for queue, jobs in retry.items():
        by_queue[queue] = jobs
    return False


def _second_strategy(state: AdmissionState, qq: QueueQuota, by_queue: dict[str, list[str]], rank: Mapping[str, int],
                     remove: Callable[[str], None], fits: Callable[[], bool],
                     stays_behind: Callable[[str, Mapping[str, int]], bool]) -> bool:
    """Rule S2-b over the candidates the first strategy left: at most one victim per queue."""
    preemptor = _standing(state, qq)
    if preemptor == INF:
        return False
    dropped: set[str] = set()
    while (queue := _next_queue(state, by_queue, rank, dropped)) is not None:
        job_id = by_queue[queue].pop(0)
        if (preemptor < _standing(state, state.book.queues[queue])
                and stays_behind(queue, state.admitted[job_id].usage)):
            remove(job_id)
            if fits():
                return True
        dropped.add(queue)
    return False

