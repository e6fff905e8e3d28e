"""The static part of hierarchical cohorts (Kueue KEP-79, pkg/cache/scheduler/resource_node.go), per cohort and
resource, computed once per configuration:

  subtree(c)   = c's own nominal + sum over children k of (subtree(k) - local(k))   (Kueue SubtreeQuota)
                 where a queue's subtree is its nominal N and its local part its guaranteed G = N - L
  local(c)     = max(0, subtree(c) - lending_limit(c)) when c has a lending limit, else 0: what c's subtree
                 keeps for itself and never lends to c's parent (Kueue localQuota)
  potential(c) = the most c's members could ever draw from c with nothing used anywhere (Kueue
                 potentialAvailable): subtree(c) at a root, else min(local(c) + potential(parent),
                 subtree(c) + borrowing_limit(c))

A flat cohort is a root without quota of its own: subtree = sum(N - G) of its queues, which is the flat
arithmetic's `lendable`, so flat configurations decide exactly as before. The dynamic part (usage per cohort,
`available`) lives in QuotaBook. The configuration is validated (no cycles, parents declared) before this runs.
"""

from __future__ import annotations

from shared.config import QueuesConfig


class CohortTree:
    __slots__ = ("borrowing_limit", "children", "lending_limit", "local", "parent", "path", "potential", "root",
                 "subtree")

    def __init__(self, config: QueuesConfig):
        self.parent: dict[str, str | None] = {c.name: c.parent for c in config.cohorts}
        self.children: dict[str, list[str]] = {c: [] for c in self.parent}
        for c in sorted(self.parent):
            p = self.parent[c]
            if p is not None:
                self.children[p].append(c)
        # a cohort's ancestors, itself first and its root last
        self.path: dict[str, tuple[str, ...]] = {}
        for c in sorted(self.parent):
            chain = [c]
            while (p := self.parent[chain[-1]]) is not None:
                chain.append(p)
            self.path[c] = tuple(chain)
        self.root: dict[str, str] = {c: chain[-1] for c, chain in self.path.items()}
        own = {c.name: c.quotas for c in config.cohorts}
        self.borrowing_limit: dict[str, dict[str, int | None]] = {
            c: {r: f.borrowing_limit for r, f in q.items()} for c, q in own.items()}
        self.lending_limit: dict[str, dict[str, int | None]] = {
            c: {r: f.lending_limit for r, f in q.items()} for c, q in own.items()}
        self.subtree: dict[str, dict[str, int]] = {c: {} for c in self.parent}
        self.local: dict[str, dict[str, int]] = {c: {} for c in self.parent}
        # what the queues put in their cohort's pool: N - G
        lent_by_queues: dict[str, dict[str, int]] = {c: {} for c in self.parent}
        for q in config.queues:
            if q.cohort is None or q.cohort not in lent_by_queues:
                continue
            pool = lent_by_queues[q.cohort]
            for r, fq in q.quotas.items():
                guaranteed = fq.nominal - fq.lending_limit if fq.lending_limit is not None else 0
                pool[r] = pool.get(r, 0) + fq.nominal - guaranteed
        # children before parents: deepest first
        for c in sorted(self.parent, key=lambda c: (-len(self.path[c]), c)):
            sub = self.subtree[c]
            for r, n in lent_by_queues[c].items():
                sub[r] = sub.get(r, 0) + n
            for r, f in own[c].items():
                sub[r] = sub.get(r, 0) + f.nominal
            for r, f in own[c].items():
                if f.lending_limit is not None:
                    self.local[c][r] = max(0, sub.get(r, 0) - f.lending_limit)
            p = self.parent[c]
            if p is not None:
                psub = self.subtree[p]
                for r, n in sub.items():
                    psub[r] = psub.get(r, 0) + n - self.local[c].get(r, 0)
        self.potential: dict[str, dict[str, int]] = {}
        for c in sorted(self.parent, key=lambda c: (len(self.path[c]), c)):  # parents first
            p = self.parent[c]
            sub = self.subtree[c]
            if p is None:
                self.potential[c] = dict(sub)
                continue
            pp = self.potential[p]
            pot: dict[str, int] = {}
            for r in sorted(set(sub) | set(pp)):
                v = self.local[c].get(r, 0) + pp.get(r, 0)
                b = self.borrowing_limit[c].get(r)
                if b is not None:
                    v = min(v, sub.get(r, 0) + b)
                pot[r] = v
            self.potential[c] = pot

    def lend_cap(self, lender: str, borrower: str, r: str) -> int | None:
        """At most how much of `r` a queue of cohort `lender` can lend to a queue of cohort `borrower`: the
        lending limits of the cohorts between the lender and the lowest common ancestor (None = no such limit;
        a bound, not the exact flow, which also depends on what the rest of those subtrees use)."""
        above = self.path.get(borrower, ())
        cap: int | None = None
        for c in self.path.get(lender, ()):
            if c in above:
                return cap
            limit = self.lending_limit[c].get(r)
            if limit is not None:
                cap = limit if cap is None else min(cap, limit)
        return cap

    def is_flat(self) -> bool:
        """No cohort has a parent or quota of its own: the arithmetic is the flat one."""
        return all(p is None for p in self.parent.values()) and not any(
            self.borrowing_limit[c] for c in self.parent)
