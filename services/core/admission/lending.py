"""Borrowing while others wait, for the admission cycle: whether a borrowing admission would take quota that a
waiting lender could not take back (the lending refusal, memoised), and the free room of a cohort held for the
preemptions and reclaims this cycle asked for (`holds`). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.core.admission.entry import Entry
from services.core.admission.fit import Fit, FitChecker
from services.core.admission.model import AdmittedWorkload
from services.core.admission.quota import QueueQuota
from services.core.admission.state import AdmissionState
from shared.config import PreemptionPolicy


class LendingGuard:
    """One cycle's view of the cohorts' waiting lenders, and the room held for its preemption requests."""

    def __init__(self, state: AdmissionState, fits: FitChecker, lists: Mapping[str, list[Entry]]):
        self.state = state
        self.book = state.book
        self.fits = fits
        self.lists = lists  # the cycle's pending lists per queue (priority order)
        # cohort -> per member queue with admissible pending jobs that fit its nominal quota: (queue, their
        # highest priority, the resources they ask), as at the cohort's first borrowing admission of the cycle
        self.waiting_lenders: dict[str, list[tuple[str, int, frozenset[str]]]] = {}
        # queue -> ((usage id, priority, preemptible, gives back cheaply) -> memo version, the same key -> the refusal
        # or None)
        self.refusals: dict[str, tuple[dict[tuple[int, int, bool, bool], int],
                                     dict[tuple[int, int, bool, bool], str | None]]] = {}
        self.usage_ids: dict[tuple[tuple[str, int], ...], int] = {}  # a fit's usage -> a small id (refusal memo)
        self.lender_usage: dict[str, tuple[tuple[tuple[str, int], ...], ...]] = {}  # cohort -> its lenders' usage
        # cohort -> (a waiting lender never reclaims, the lowest top priority of the LowerPriority ones)
        self.lender_summary: dict[str, tuple[bool, float]] = {}
        # cohort -> (the version it was computed at, per resource its waiting lenders' unused lendable quota)
        self.lender_unused: dict[str, tuple[int, dict[str, list[tuple[str, int, PreemptionPolicy, int]]]]] = {}
        # pool -> (cohort, resource) -> the free room of that cohort this cycle's preemption requests count on, with
        # the first preemptor: no later admission of the cycle borrows it (Kueue reserves a preempting entry's
        # resources for the rest of the cycle), else the victims would free too little and the request repeat
        self.holds: dict[str, dict[tuple[str, str], tuple[int, str]]] = {}
        # `held`'s answers per (pool, the fit's usage id): valid while no hold moved (`holds_serial`) and nothing
        # was admitted in the pool (the fit memo's version); a deep queue of borrowers is judged against the same
        # holds job after job
        self.holds_serial = 0
        self.held_memo: dict[tuple[str, int], tuple[int, int, str | None]] = {}
        # the earliest a waiting lender can take a loan back: a borrower starts no earlier than it is admitted and
        # is protected for the window after its start (services/core/preemption/policy.py `protection`)
        self.take_back_s = float(state.config.policy.protection_window_s)
        self.loss_aware = state.config.policy.loss_aware_reclaim

    def forget_refusals(self) -> None:
        """Before the refused queues are nominated again: admissions since may have changed every refusal."""
        self.refusals.clear()
        self.lender_unused.clear()

    def refusal(self, qq: QueueQuota, e: Entry, fit: Fit, version: int) -> str | None:
        """`lending_refused`, memoised per (queue, usage, priority, preemptible) until the scope changes: a
        deep queue of borrowing jobs a lender holds its quota back from costs one lookup per job. Keyed by the
        fit's usage, not the job's request: the refusal reads nothing else of the job, and many different
        requests (pod counts, any-of models) end with the same usage."""
        memo = self.refusals.get(qq.name)
        if memo is None:
            memo = self.refusals[qq.name] = ({}, {})
        versions, verdicts = memo  # two dicts of untracked values, not a tuple per entry: fewer objects for
        # the collector to count and promote while the cycle runs
        usage_id = fit.usage_id
        if usage_id is None:
            usage_id = fit.usage_id = self.usage_ids.setdefault(tuple(fit.usage.items()), len(self.usage_ids))
        key = (usage_id, e.priority, e.preemptible, self.gives_back(e))
        if versions.get(key) == version:
            return verdicts[key]
        refused = self.lending_refused(qq, e, fit)
        versions[key] = version
        verdicts[key] = refused
        return refused

    def gives_back(self, e: Entry) -> bool:
        """Whether a waiting lender that may take `e` back would lose little by it (issue 49): `e` is preemptible
        and either checkpoints (a reclaim costs its checkpoint write) or is predicted to end before the lender
        could take it back (`take_back_s`: the protection window from its start). Its predicted run is the
        predictor's when admission was given one (`Workload.predicted_gpu_s` over its GPUs), else its limit
        (`max_runtime_s`); never its true duration. A job that would lose its whole run to the reclaim is lent
        no quota a waiting lender could use: it would run one window and be thrown away."""
        if not e.preemptible:
            return False
        if not self.loss_aware:  # policy.loss_aware_reclaim off: every preemptible job gives back as before
            return True
        if e.unsaved_runtime_s <= self.take_back_s:  # checkpoints (0), or its limit ends within the window
            return True
        w = e.workload
        gpus = w.spec.total_gpus
        return w.predicted_gpu_s is not None and gpus > 0 and w.predicted_gpu_s / gpus <= self.take_back_s

    def lending_refused(self, qq: QueueQuota, e: Entry, fit: Fit) -> str | None:
        """Lending while the lender waits (decision, issue 15 item 4, where Kueue is reported to refuse too):
        a borrowing admission may not use the unused lendable quota of another queue of the cohort that has
        admissible pending jobs fitting its nominal quota (jobs that would themselves borrow are owed nothing)
        that ask for that resource, and whose reclaim policy could not take this job back
        (`reclaim_within_cohort: Never`; `LowerPriority` and this job's priority is not below the lender's
        highest pending one; or this job is not preemptible), or could only at the cost of the job's run: it
        cannot checkpoint and is predicted to run past the lender's earliest take-back (`gives_back`). It may
        still borrow what other lenders lend. The message when refused, else None."""
        cohort = qq.pool  # the lenders of the whole cohort tree
        if cohort is None or qq.cohort is None:
            return None
        lenders = self.lenders_of(cohort)
        if not lenders:
            return None
        never, lowest_top = self.lender_summary[cohort]
        cheap = self.gives_back(e)
        if cheap and not never and e.priority < lowest_top:
            return None  # every waiting lender could take this job back, losing little
        book = self.book
        q = qq.name
        unused_by = self.lenders_unused(cohort, self.fits.version_of(qq), lenders)
        for r, total in sorted(fit.usage.items()):
            used, nominal, guaranteed = book.used(q, r), qq.nominal.get(r, 0), qq.guaranteed.get(r, 0)
            borrowed = used + total - max(used, nominal)  # what this admission takes above its nominal quota
            if borrowed <= 0:
                continue
            held = 0
            holders = []
            for lender, priority, policy, unused in unused_by.get(r, ()):
                if lender == q:
                    continue
                if not book.flat:  # in a cohort tree, only what can reach this queue is held back from it
                    cap = book.tree.lend_cap(book.queues[lender].cohort or "", qq.cohort, r)
                    if cap is not None:
                        unused = min(unused, cap)
                        if unused <= 0:
                            continue
                if cheap and (policy is PreemptionPolicy.ANY or (
                        policy is PreemptionPolicy.LOWER_PRIORITY and e.priority < priority)):
                    continue  # the lender could take it back when it needs it, losing little
                held += unused
                holders.append(lender)
            if not held:
                continue
            own_unused = max(0, nominal - guaranteed - max(0, used - guaranteed))
            lendable = book.cohort_available(qq.cohort, r) - own_unused - held
            if borrowed > lendable:
                return (f"needs to borrow {borrowed} {r}; cohort {qq.cohort} could lend {max(0, lendable)} without "
                        f"the {held} unused {r} of {', '.join(holders)}, which have jobs waiting and could not "
                        f"take a loan to this job back (reclaim_within_cohort)" + ("" if cheap or not e.preemptible else
                        f" without throwing away its run: it cannot checkpoint and may run past the "
                        f"{self.take_back_s:.0f}s protection window"))
        return None

    def hold(self, qq: QueueQuota, request: Mapping[str, int], first: str) -> None:
        """Hold the free room of `qq`'s cohort that a preemption asked for `request` counts on (`holds`)."""
        if qq.cohort is None or qq.pool is None:
            return  # nothing shares its quota
        holds = self.holds.setdefault(qq.pool, {})
        for r, amount in sorted(request.items()):
            held, who = holds.get((qq.cohort, r), (0, first))
            room = min(held + amount, max(0, self.book.cohort_available(qq.cohort, r)))
            if room > held:
                holds[(qq.cohort, r)] = (room, who)
                self.holds_serial += 1

    def hold_if_coverable(self, qq: QueueQuota, request: Mapping[str, int], first: str,
                           *needs: tuple[tuple[str, ...], Mapping[str, int]]) -> None:
        """`hold`, but only when the request can be met: for each (candidates, what they must free) in `needs`,
        the candidates' admitted usage covers it. Preempting a job gives back what admission charged it, and the
        preemption core frees a quota request only from such candidates (fewer of them: only running jobs, none
        inside its protection window, guarantees kept), so when their usage falls short no set of victims can make
        the room and the request fails; holding the free room for it would only keep that room idle, from every
        borrower of the cohort, for as long as the job waits. (The request itself is still made.)"""
        admitted = self.state.admitted
        if all(covered(admitted, candidates, need) for candidates, need in needs):
            self.hold(qq, request, first)

    def held(self, qq: QueueQuota, fit: Fit) -> str | None:
        """Whether borrowing `fit` would take free room that a reclaim of this cycle counts on (`holds`): the
        message if so, else None."""
        pool = qq.pool or ""
        usage_id = fit.usage_id
        if usage_id is None:
            usage_id = fit.usage_id = self.usage_ids.setdefault(tuple(fit.usage.items()), len(self.usage_ids))
        version = self.fits.version_of(qq)
        hit = self.held_memo.get((pool, usage_id))
        if hit is not None and hit[0] == self.holds_serial and hit[1] == version:
            return hit[2]
        found = None
        for (cohort, r), (room, first) in self.holds[pool].items():
            u = fit.usage.get(r, 0)
            if u and self.book.cohort_available(cohort, r) - u < room:
                found = (f"needs to borrow {u} {r}; the {room} {r} left in cohort {cohort} are held for the jobs "
                         f"preempting or reclaiming this cycle ({first})")
                break
        self.held_memo[(pool, usage_id)] = (self.holds_serial, version, found)
        return found

    def lenders_unused(self, cohort: str, version: int, lenders: list[tuple[str, int, frozenset[str]]]
                        ) -> dict[str, list[tuple[str, int, PreemptionPolicy, int]]]:
        """Per resource, the waiting lenders that ask for it and still lend some of it: (lender, its top
        pending priority, its reclaim policy, its unused lendable amount), in `lenders` order. Depends only on
        the cohort's usage, so it is kept while `version` (the cohort's memo version) holds, within one pass."""
        hit = self.lender_unused.get(cohort)
        if hit is not None and hit[0] == version:
            return hit[1]
        book = self.book
        by: dict[str, list[tuple[str, int, PreemptionPolicy, int]]] = {}
        for lender, priority, resources in lenders:
            lq = book.queues[lender]
            for r in sorted(resources):
                g = lq.guaranteed.get(r, 0)
                unused = max(0, lq.nominal.get(r, 0) - g - max(0, book.used(lender, r) - g))
                if unused > 0:
                    by.setdefault(r, []).append((lender, priority, lq.reclaim_policy, unused))
        self.lender_unused[cohort] = (version, by)
        return by

    def lenders_changed(self, refused_at: Mapping[str, int]) -> bool:
        """Did the waiting lenders (who, what they are owed, what they still lend) of the cohorts where borrowing
        was refused change since? Only then can a refusal turn into an admission. Recomputes them."""
        changed = False
        cohorts = {c for q in refused_at if (c := self.book.queues[q].pool) is not None}
        for cohort in sorted(cohorts):
            before = self.waiting_lenders.pop(cohort, None)
            before_use = self.lender_usage.get(cohort)
            after = self.lenders_of(cohort)
            if before != after or before_use != self.lender_usage.get(cohort):
                changed = True
        return changed

    def lenders_of(self, cohort: str) -> list[tuple[str, int, frozenset[str]]]:
        found = self.waiting_lenders.get(cohort)
        if found is not None:
            return found
        found = []
        for member in self.book.pool_members.get(cohort, ()):
            mq = self.book.queues.get(member)
            if mq is None or mq.held:  # a held queue admits nothing, so it is owed nothing back yet
                continue
            if not any(n - mq.guaranteed.get(r, 0) - max(0, self.book.used(member, r) - mq.guaranteed.get(r, 0)) > 0
                       for r, n in mq.nominal.items()):
                continue  # lends nothing now (nor later in this cycle: usage only grows), so holds nothing back
            top: int | None = None
            resources: set[str] = set()
            every = mq.nominal.keys()  # a request within nominal asks for nothing else
            owed: dict[int, dict[str, int] | None] = {}  # sid -> its request within nominal, None if it must borrow
            for e in self.lists.get(member, ()):  # priority order: the first owed job has the top priority
                if e.sid in owed or e.verdict is not None or e.admitted is not None:
                    continue
                request = owed[e.sid] = self.fits.reclaim_need(mq, e.sig)
                if request is not None:  # a job that would itself borrow is owed no loan back
                    top = e.priority if top is None else max(top, e.priority)
                    resources.update(request)
                    if resources >= every:
                        break  # later jobs (of no higher priority) can add neither a resource nor a higher top
            if top is not None:
                found.append((member, top, frozenset(resources)))
        self.waiting_lenders[cohort] = found
        policies = [(self.book.queues[m].reclaim_policy, top) for m, top, _r in found]
        self.lender_summary[cohort] = (
            any(p is PreemptionPolicy.NEVER for p, _t in policies),
            min((float(t) for p, t in policies if p is PreemptionPolicy.LOWER_PRIORITY), default=float("inf")))
        self.lender_usage[cohort] = tuple(tuple(sorted(self.book.usage[m].items())) for m, _p, _r in found)
        return found


def covered(admitted: Mapping[str, AdmittedWorkload], candidates: Sequence[str], need: Mapping[str, int]) -> bool:
    """Whether the admitted usage of `candidates` covers `need` (every positive amount), resource by resource:
    usage is never negative, so a resource is covered once the running sum over the candidates reaches its need."""
    for r, n in sorted(need.items()):
        if n <= 0:
            continue
        for c in candidates:
            n -= admitted[c].usage.get(r, 0)
            if n <= 0:
                break
        else:
            return False
    return True
