"""What an admission cycle may skip: the scopes (cohorts, or queues without one) unchanged since a cycle that
admitted nothing there, whose decisions it reuses, and the sealed queues, whose jobs' reasons depend on the queue
alone. Reads and refreshes the state's CycleMemo (cycle_memo.py). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.core.admission.entry import Entry
from services.core.admission.messages import LazyText, rewrite_when_read
from services.core.admission.model import AdmissionDecision, ReclaimRequest
from services.core.admission.ordering import Order
from services.core.admission.reclaim_requests import PreemptionAsks
from services.core.admission.resources import Signature
from services.core.admission.state import AdmissionState


class ScopeReuse:
    """One cycle's reuse of the last cycles' decisions (enabled only when scopes are independent: no capacity cap,
    no maximum of admissions)."""

    def __init__(self, state: AdmissionState, asks: PreemptionAsks, lists: Mapping[str, list[Entry]],
                 enabled: bool):
        self.state = state
        self.book = state.book
        self.asks = asks
        self.lists = lists  # the cycle's pending lists per queue (priority order)
        self.enabled = enabled  # scopes are independent: reuse caches
        self.scopes = {q: state.scope_of(q) for q in lists}  # queue -> scope (its cohort, or itself)
        self.clean: set[str] = set()  # scopes unchanged since their cached result
        self.sealed: set[str] = set()  # queues whose reasons stand (CycleMemo.sealed): not judged again
        memo = state.cycle_memo
        if enabled:
            self.clean = {sc for sc in set(self.scopes.values())
                          if sc in memo.reclaims and sc not in memo.stale}
            self.sealed = self.still_sealed()
        else:
            memo.sealed.clear()  # this cycle's reasons are capped or cut short: the next one judges them again

    def skips(self, q: str) -> bool:
        """Whether the cycle keeps `q`'s jobs' reasons instead of judging them (its scope reused, or sealed)."""
        return self.scopes[q] in self.clean or q in self.sealed

    def finish(self, decision: AdmissionDecision, scope_reclaims: Mapping[str, list[ReclaimRequest]],
               scope_admitted: set[str], admitted_queues: set[str],
               by_scope: dict[str, list[list[Entry]]] | None) -> frozenset[str]:
        """After the cycle: the reclaims of every scope (reused ones from the cache) into `decision`, the caches
        refreshed, the queues sealed; returns the settled queues (`settled`) when explaining (`by_scope`)."""
        memo = self.state.cycle_memo
        cache = memo.reclaims
        for sc in sorted(set(self.scopes.values()) | set(scope_reclaims)):
            decision.reclaims.extend(cache[sc] if sc in self.clean else scope_reclaims.get(sc, ()))
        if not self.enabled:
            # the entries now carry this cycle's reasons (capacity-capped or cut short), not the cached cycles'
            cache.clear()
            memo.scope_ends.clear()
            return frozenset()
        for sc in sorted(set(self.scopes.values()) - self.clean):
            if sc in scope_admitted:
                cache.pop(sc, None)
            else:
                cache[sc] = scope_reclaims.get(sc, [])
                memo.stale.discard(sc)
        self.seal(admitted_queues)
        return self.settled(by_scope) if by_scope is not None else frozenset()

    def queue_alone(self, q: str, lst: list[Entry], sigs: tuple[Signature, ...]) -> bool:
        """Whether the reasons of `q`'s pending jobs (`lst`, whose distinct requests are `sigs`) depend on the
        queue alone, whatever the rest of its cohort does: it is held, or runs its max_running_jobs, or none of
        its jobs' first pod set fits any option even if the cohort lent everything (its usage plus the option
        passes nominal + borrowing limit: no admission, no reclaim, which needs room within nominal, no borrowing)
        and no job could ask the queue's own jobs to make room (within-queue preemption takes only strictly lower
        priorities; the list is in order, so its head has the highest)."""
        qq = self.book.queues.get(q)
        if qq is None or qq.cohort is None:
            return False
        if qq.held or (qq.max_running is not None and self.book.running.get(q, 0) >= qq.max_running):
            return True
        used = self.book.usage[q]
        for sig in sigs:
            if not sig:
                return False  # asks for no GPU: it fits
            for _m, r, amount in self.state.options(qq, sig[0]):
                limit = qq.borrowing_limit.get(r)
                if limit is None or used.get(r, 0) + amount <= qq.nominal[r] + limit:
                    return False
        return not qq.can_preempt_within or not lst or lst[0].priority <= self.asks.lowest_preemptible(q)

    def still_sealed(self) -> set[str]:
        """The sealed queues whose reasons stand this cycle. Their jobs' reasons depend on the queue alone, so
        while nothing of the queue changed (AdmissionState._touch unseals it) a cycle would give each job the
        same reason again; only the cohort's numbers in their messages move, and those messages are written
        again when next read. Checked again here (cheap: per distinct request), not trusted from the last cycle."""
        sealed = self.state.cycle_memo.sealed
        found: set[str] = set()
        for q in sorted(sealed):
            lst = self.lists.get(q)
            messages, sigs, _ = sealed[q]
            if lst is not None and self.scopes[q] in self.clean:
                found.add(q)  # its whole scope is reused anyway
            elif lst is not None and self.queue_alone(q, lst, sigs):
                found.add(q)
                for message in messages:
                    rewrite_when_read(message)
            else:
                del sealed[q]
        return found

    def seal(self, admitted_queues: set[str]) -> None:
        """After the cycle: seal the queues judged now whose reasons depend on the queue alone and that admitted
        nothing this cycle (a job judged before the queue's last admission may carry a reason of the queue as it
        was then)."""
        state = self.state
        sealed = state.cycle_memo.sealed
        for q in sorted(self.lists):
            if q in self.sealed or self.scopes[q] in self.clean:
                continue
            lst = state.pending_list(q)
            if lst is None or q in admitted_queues:
                sealed.pop(q, None)
                continue
            sigs = tuple({e.sid: e.sig for e in lst if e.verdict is None}.values())
            if not self.queue_alone(q, lst, sigs):
                sealed.pop(q, None)
                continue
            messages = {id(e.message): e.message for e in lst if isinstance(e.message, LazyText)}
            state.cycle_memo.seal_count += 1
            sealed[q] = (tuple(messages.values()), sigs, state.cycle_memo.seal_count)

    def settled(self, by_scope: dict[str, list[list[Entry]]]) -> frozenset[str]:
        """The sealed queues whose statuses equal the last explaining cycle's but for the numbers in their
        messages: their positions in the cohort moved only if another queue's pending jobs (or their order)
        did. Records this cycle's lists for the next: a sealed queue's as its seal's serial (O(1)), which stands
        for its list as long as it stays sealed, so that a queue sealed then and not now (its jobs gone, say) or
        sealed again since (its list changed in between) counts as moved."""
        memo = self.state.cycle_memo
        scope_ends, sealed = memo.scope_ends, memo.sealed
        settled: set[str] = set()
        for sc in sorted(by_scope):
            if sc in self.clean:
                continue
            lists = by_scope[sc]
            ends: dict[str, list[Order] | int] = {}
            here = []
            for lst in lists:
                q = lst[0].queue
                seal = sealed.get(q) if q in self.sealed else None
                if seal is not None:
                    here.append(q)
                    ends[q] = seal[2]
                else:
                    ends[q] = [e.order for e in lst]
            before = scope_ends.get(sc)
            if here and before is not None and all(before.get(q) == ends.get(q) for q in sorted(set(before)
                                                                                                 | set(ends))):
                settled.update(here)
            scope_ends[sc] = ends
        return frozenset(settled)
