"""Kueue's quota arithmetic for queues in flat cohorts, kept incrementally.

Per queue q and resource r (Kueue pkg/cache resource_node.go, `available()`):
  nominal N, borrowing limit B (None = unlimited), lending limit L (None = N), guaranteed G = N - L
  (the part of nominal that is never lent), usage U.
  A cohort pools every member's lendable part:  lendable_c = sum(N - G),  used_c = sum(max(0, U - G)).
  available(q) = max(0, G - U) + min(lendable_c - used_c,  (N - G) - max(0, U - G) + B)
  A queue without cohort has available = N - U and can never borrow.
A request fits if it is <= available; it borrows if U + request > N. Because the cohort only ever hands out
`lendable_c`, what others borrow from a queue never exceeds its lending limit, and usage never exceeds
N + B. Everything is integers.

Hierarchical cohorts (Kueue KEP-79, resource_node.go `available()`/`addUsage()`): a cohort with a parent is a
node like a queue, with its subtree's quota S (core/cohort_tree.py), its local part Lc (kept from its parent
by a lending limit), its own borrowing limit, and its usage U_c = sum over children of max(0, U_k - local_k).
  available(root c)  = S_c - U_c
  available(child c) = max(0, Lc - U_c) + min(available(parent), S_c - Lc - max(0, U_c - Lc) + B_c)
and a queue's available is the formula above with `lendable_c - used_c` replaced by available(its cohort).
A flat cohort is a root without quota of its own (S = lendable, U = used): the same numbers as before.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

from services.core.admission.cohort_tree import CohortTree
from services.core.admission.resources import GpuOption, base_model, non_gpu_keys, quota_models
from shared.config import PreemptionPolicy, QueueConfig, QueueingStrategy, QueuesConfig, StopPolicy

INF = float("inf")


class QueueQuota:
    """The static, per-queue part of the arithmetic, pre-digested from QueueConfig."""

    __slots__ = (
        "borrow_threshold",
        "borrowing_limit",
        "can_preempt_within",
        "can_reclaim",
        "cohort",
        "config",
        "guaranteed",
        "held",
        "max_running",
        "models",
        "name",
        "nominal",
        "non_gpu",
        "pool",
        "reclaim_policy",
        "scope",
        "strict_fifo",
        "teams",
        "unsafe_borrow_limit",
        "weight",
    )

    def __init__(self, q: QueueConfig, root: str | None = None):
        self.config = q
        self.name = q.name
        self.cohort = q.cohort
        # the root of its cohort tree (its cohort when flat): every queue under it shares quota with it
        self.pool = root if root is not None else q.cohort
        # what an admission elsewhere can change for this queue: its cohort tree's pool, or only itself
        self.scope = f"cohort/{self.pool}" if self.pool is not None else f"queue/{q.name}"
        self.nominal = {r: f.nominal for r, f in q.quotas.items()}
        self.guaranteed = {r: (f.nominal - f.lending_limit if f.lending_limit is not None else 0)
                           for r, f in q.quotas.items()}
        self.borrowing_limit = {r: f.borrowing_limit for r, f in q.quotas.items()}
        self.models = quota_models(q.quotas)
        self.non_gpu = non_gpu_keys(q.quotas)  # cpu_milli, memory_mib, pods, pool/<name> it sets: charged too
        self.weight = q.weight
        self.max_running = q.max_running_jobs
        self.strict_fifo = q.queueing_strategy is QueueingStrategy.STRICT_FIFO
        self.reclaim_policy = q.preemption.reclaim_within_cohort
        self.teams = frozenset(q.teams)
        self.can_reclaim = self.cohort is not None and self.reclaim_policy is not PreemptionPolicy.NEVER
        self.can_preempt_within = q.preemption.within_queue is not PreemptionPolicy.NEVER
        # admits nothing, asks nothing of others (HoldAndDrain also evicts its admitted jobs: the service does that)
        self.held = q.stop_policy in (StopPolicy.HOLD, StopPolicy.HOLD_AND_DRAIN)
        # borrow_within_cohort: highest victim priority when a job preempts borrowers in order to borrow (None = off)
        bwc = q.preemption.borrow_within_cohort
        self.borrow_threshold: float | None = None
        if bwc.policy is PreemptionPolicy.LOWER_PRIORITY and self.can_reclaim:
            self.borrow_threshold = (float(bwc.max_priority_threshold) if bwc.max_priority_threshold is not None
                                     else float("inf"))
        # jobs that cannot checkpoint borrow only up to this max_runtime_s (None = no limit)
        self.unsafe_borrow_limit = q.max_borrow_runtime_without_checkpoint_s

    @property
    def quotas(self) -> Mapping[str, object]:
        return self.config.quotas



class QuotaBook:
    """Quotas of a QueuesConfig plus the usage of admitted work, per queue and per cohort."""

    def __init__(self, config: QueuesConfig):
        self.config = config
        self.tree = CohortTree(config)
        self.flat = self.tree.is_flat()
        roots = self.tree.root
        self.queues: dict[str, QueueQuota] = {q.name: QueueQuota(q, roots.get(q.cohort) if q.cohort else None)
                                              for q in config.queues}
        self.cohort_members: dict[str, tuple[str, ...]] = {}  # cohort -> its own queues
        self.pool_members: dict[str, tuple[str, ...]] = {}  # root cohort -> every queue of its tree
        for q in sorted(self.queues):
            qq = self.queues[q]
            if qq.cohort is not None and qq.pool is not None:
                self.cohort_members[qq.cohort] = (*self.cohort_members.get(qq.cohort, ()), q)
                self.pool_members[qq.pool] = (*self.pool_members.get(qq.pool, ()), q)
        if self.flat:
            self.cohort_lendable: dict[str, dict[str, int]] = {c: {} for c in self.cohort_members}
            for qq in self.queues.values():
                if qq.cohort is not None:
                    lend = self.cohort_lendable[qq.cohort]
                    for r, n in qq.nominal.items():
                        lend[r] = lend.get(r, 0) + n - qq.guaranteed[r]
        else:
            # every declared cohort is a node (an inner one may have no queue of its own); subtree quota
            self.cohort_lendable = {c: dict(v) for c, v in self.tree.subtree.items()}
        self.cohort_used: dict[str, dict[str, int]] = {c: {} for c in self.cohort_lendable}
        # per cohort, what a member's borrowing is measured against in the fair share (Kueue calculateLendable:
        # the cohort's potentialAvailable; for a flat cohort its lendable)
        self.share_pool: dict[str, dict[str, int]] = (self.cohort_lendable if self.flat
                                                      else {c: dict(v) for c, v in self.tree.potential.items()})
        # usage survives for queues that a config change deleted (admitted jobs stay admitted)
        self.usage: dict[str, dict[str, int]] = {q: {} for q in self.queues}
        self.running: dict[str, int] = dict.fromkeys(self.queues, 0)
        self.flavor_weight: dict[str, float] = {m: f.weight for m, f in config.gpu_flavors.items()}
        # pod set options per (queue, demand); static for a given config
        self.options_cache: dict[tuple[str, object], tuple[GpuOption, ...]] = {}

    # ------------------------------------------------------------------ bookkeeping


    def copy(self) -> QuotaBook:
        """A copy whose usage, running counts and memo change apart from this book's; the configuration and the
        static structure (queues, cohort tree, lendable pools) are immutable and shared."""
        other = copy.copy(self)
        other.usage = {q: dict(u) for q, u in self.usage.items()}
        other.running = dict(self.running)
        other.cohort_used = {c: dict(u) for c, u in self.cohort_used.items()}
        other.options_cache = dict(self.options_cache)  # a memo both sides add to
        return other
    def add(self, queue: str, usage: Mapping[str, int], sign: int = 1) -> None:
        """Charge (sign=+1) or release (sign=-1) an admitted job's usage; O(resources)."""
        own = self.usage.setdefault(queue, {})
        qq = self.queues.get(queue)
        cohort_used = None
        cohort = ""
        guaranteed: Mapping[str, int] = {}
        if qq is not None and qq.cohort is not None:
            cohort = qq.cohort
            cohort_used, guaranteed = self.cohort_used[cohort], qq.guaranteed
        for r, amount in usage.items():
            old = own.get(r, 0)
            new = old + sign * amount
            own[r] = new
            if cohort_used is not None:
                g = guaranteed.get(r, 0)
                delta = max(0, new - g) - max(0, old - g)
                cohort_used[r] = cohort_used.get(r, 0) + delta
                if delta and not self.flat:
                    self._bubble(cohort, r, delta)
        self.running[queue] = self.running.get(queue, 0) + sign

    def _bubble(self, cohort: str, r: str, delta: int) -> None:
        """Kueue addUsage/removeUsage: a cohort's usage past its local quota is usage of its parent."""
        tree = self.tree
        node = cohort
        while delta:
            parent = tree.parent[node]
            if parent is None:
                return
            new = self.cohort_used[node].get(r, 0)
            old = new - delta
            local = tree.local[node].get(r, 0)
            delta = max(0, new - local) - max(0, old - local)
            if delta:
                pu = self.cohort_used[parent]
                pu[r] = pu.get(r, 0) + delta
            node = parent

    # ------------------------------------------------------------------ arithmetic

    def nominal(self, queue: str, r: str) -> int:
        qq = self.queues.get(queue)
        return qq.nominal.get(r, 0) if qq is not None else 0

    def used(self, queue: str, r: str) -> int:
        return self.usage.get(queue, {}).get(r, 0)

    def cohort_available(self, cohort: str, r: str) -> int:
        """Unused lendable quota left in the cohort's pool (in a tree: what its members may draw from it,
        its ancestors' limits and usage included)."""
        avail = self.cohort_lendable[cohort].get(r, 0) - self.cohort_used[cohort].get(r, 0)
        if self.flat:
            return avail
        parent = self.tree.parent[cohort]
        if parent is None:
            return avail
        local = self.tree.local[cohort].get(r, 0)
        used = self.cohort_used[cohort].get(r, 0)
        above = self.cohort_available(parent, r)
        b = self.tree.borrowing_limit[cohort].get(r)
        if b is not None:
            above = min(above, self.cohort_lendable[cohort].get(r, 0) - local - max(0, used - local) + b)
        return max(0, local - used) + above

    def available(self, qq: QueueQuota, r: str) -> int:
        n = qq.nominal.get(r)
        if n is None:
            return 0
        u = self.usage[qq.name].get(r, 0)
        if qq.cohort is None:
            return n - u
        g = qq.guaranteed[r]
        parent = (self.cohort_lendable[qq.cohort].get(r, 0) - self.cohort_used[qq.cohort].get(r, 0) if self.flat
                  else self.cohort_available(qq.cohort, r))
        b = qq.borrowing_limit[r]
        if b is not None:
            parent = min(parent, (n - g) - max(0, u - g) + b)
        return max(0, g - u) + parent

    def max_available(self, qq: QueueQuota, r: str) -> int:
        """What `available` would be with nothing admitted anywhere: the most this queue can ever hold."""
        n = qq.nominal.get(r)
        if n is None:
            return 0
        if qq.cohort is None:
            return n
        g = qq.guaranteed[r]
        parent = self.share_pool[qq.cohort].get(r, 0)
        b = qq.borrowing_limit[r]
        if b is not None:
            parent = min(parent, (n - g) + b)
        return g + parent

    def nominal_of(self, qq: QueueQuota, r: str) -> int:
        """The most a job that never borrows (one that is not preemptible) can ever hold: the nominal quota."""
        return qq.nominal.get(r, 0)

    def borrowed(self, queue: str, r: str) -> int:
        return max(0, self.used(queue, r) - self.nominal(queue, r))

    def share(self, qq: QueueQuota, extra: Mapping[str, int]) -> float:
        """Kueue fair_sharing.go dominant resource share after admitting `extra`, divided by the queue weight:
        per resource borrowed = max(0, U + request - N); DRS = max(borrowed * w_model * 1000 / lendable_cohort),
        where w_model is the GPU model's fair-share weight (QueuesConfig.gpu_flavors). Lower is served first.
        A float is fine here: it only orders queues, it never enters quota arithmetic."""
        if qq.cohort is None:
            return 0.0
        own = self.usage[qq.name]
        lendable = self.share_pool[qq.cohort]
        drs = 0.0
        for r in _union(own, extra):
            borrowed = own.get(r, 0) + extra.get(r, 0) - qq.nominal.get(r, 0)
            if borrowed <= 0:
                continue
            pool = lendable.get(r, 0)
            ratio = borrowed * self.flavor_weight.get(base_model(r), 1.0) * 1000 / (pool if pool > 0 else 1)
            drs = max(drs, ratio)
        if drs == 0.0:
            return 0.0
        return drs / qq.weight if qq.weight > 0 else INF


def _union(a: Mapping[str, int], b: Mapping[str, int]) -> Iterable[str]:
    if not b:
        return a
    if not a:
        return b
    return set(a) | set(b)
