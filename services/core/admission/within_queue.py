"""Within-queue preemption candidates: which of a queue's own admitted jobs a higher-priority job of the same queue
may take the place of. Over the queue's entries, not the state, so the state can keep the answers (state.py
`own_candidates`) without an import cycle."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping

from services.core.admission.entry import Entry
from services.core.admission.quota import QueueQuota
from shared.config import PreemptionPolicy


def own_candidates(entries: Iterable[Entry], qq: QueueQuota, priority: int, need: Mapping[str, int], *,
                   ckpt_first: bool) -> tuple[str, ...]:
    """Within-queue preemption candidates (Kueue `withinClusterQueue: LowerPriority`; `Any` is read the same):
    of `entries` (the queue's admitted jobs), the preemptible ones of strictly lower priority that use a needed
    resource, in the same order as reclaim candidates (reclaim.py: lowest priority, checkpointing first when
    `ckpt_first` (policy.loss_aware_reclaim, issue 49), most recently admitted, job id)."""
    if qq.config.preemption.within_queue is PreemptionPolicy.NEVER:
        return ()
    found: list[tuple[int, bool, float, str]] = []
    for e in entries:
        a = e.admitted
        if a is None or not e.preemptible or e.priority >= priority:
            continue
        if any(a.usage.get(r, 0) > 0 for r in need):
            found.append((e.priority, ckpt_first and e.unsaved_runtime_s > 0, -a.admitted_at, e.job_id))
    found.sort()
    return tuple(job_id for _p, _u, _t, job_id in found)


class AdmittedIndex:
    """What the admission state keeps of each queue's admitted jobs for within-queue preemption, as jobs are
    admitted and released: each queue's preemptible admitted jobs in candidate order (priority, most recently
    admitted, job id: `own_candidates` reads a prefix of it instead of scanning and sorting every admitted job),
    the answers of `own_candidates` (valid while the queue's admitted jobs do not change: a queue with a deep backlog
    asks for the same few priorities every cycle) and so the lowest priority among its preemptible admitted jobs
    (the first of them, not a scan each cycle)."""

    __slots__ = ("_by_id", "_ids", "_keys", "_memo", "_ordered", "_serial", "_uses", "_using")

    def __init__(self) -> None:
        # queue -> how many times its admitted jobs changed (an admission or a release): what the memo is keyed by
        self._serial: dict[str, int] = {}
        self._memo: dict[tuple[str, int, tuple[str, ...]], tuple[int, tuple[str, ...]]] = {}
        # queue -> its preemptible admitted jobs' (priority, -admitted_at, job id), sorted; job id -> that key and
        # its entry (a release finds its key here: the entry's admission is gone by then)
        self._ordered: dict[str, list[tuple[int, float, str]]] = {}
        self._keys: dict[str, tuple[int, float, str]] = {}
        self._by_id: dict[str, Entry] = {}
        # queue -> the same jobs' ids in the same order; queue -> resource -> how many of them use it (job id -> the
        # resources it uses, for its release): when all of them use a needed resource, the answer is a prefix of ids
        self._ids: dict[str, list[str]] = {}
        self._using: dict[str, dict[str, int]] = {}
        self._uses: dict[str, tuple[str, ...]] = {}

    def copy(self) -> AdmittedIndex:
        other = AdmittedIndex()
        other._serial = dict(self._serial)
        other._memo = dict(self._memo)
        other._ordered = {q: list(keys) for q, keys in self._ordered.items()}
        other._keys = dict(self._keys)
        other._by_id = dict(self._by_id)
        other._ids = {q: list(ids) for q, ids in self._ids.items()}
        other._using = {q: dict(c) for q, c in self._using.items()}
        other._uses = dict(self._uses)
        return other

    def rebuild(self, admitted: Iterable[Entry]) -> None:
        """After a configuration change (classes' values, preemptibility and the preemption rules may differ)."""
        self._memo.clear()
        self._ordered, self._keys, self._by_id, self._ids, self._using, self._uses = {}, {}, {}, {}, {}, {}
        for e in admitted:
            self._order(e, 1)

    def changed(self, e: Entry, sign: int) -> None:
        """`e` was admitted (sign 1) or released (-1)."""
        self._serial[e.queue] = self._serial.get(e.queue, 0) + 1
        self._order(e, sign)

    def own_candidates(self, qq: QueueQuota, priority: int, need: Mapping[str, int], *,
                       ckpt_first: bool) -> tuple[str, ...]:
        """`own_candidates` over `qq`'s admitted jobs, kept while they do not change."""
        key = (qq.name, priority, tuple(sorted(need)))
        serial = self._serial.get(qq.name, 0)
        hit = self._memo.get(key)
        if hit is not None and hit[0] == serial:
            return hit[1]
        found = self._candidates(qq, priority, need, ckpt_first)
        self._memo[key] = (serial, found)
        return found

    def _candidates(self, qq: QueueQuota, priority: int, need: Mapping[str, int], ckpt_first: bool
                    ) -> tuple[str, ...]:
        """`own_candidates` over the queue's ordered preemptible jobs of lower priority (a prefix of them); all of
        it when each of them uses a needed resource and checkpointing ones do not go first (already in candidate
        order: no scan)."""
        ordered = self._ordered.get(qq.name)
        if not ordered or qq.config.preemption.within_queue is PreemptionPolicy.NEVER:
            return ()
        end = bisect_left(ordered, (priority,))
        if not ckpt_first:
            using = self._using[qq.name]
            if any(using.get(r, 0) == len(ordered) for r in need):  # every one of them qualifies
                return tuple(self._ids[qq.name][:end])
        return own_candidates((self._by_id[job_id] for _p, _t, job_id in ordered[:end]), qq, priority, need,
                              ckpt_first=ckpt_first)

    def lowest_preemptible(self, queue: str) -> float:
        """The lowest priority among `queue`'s admitted preemptible jobs (+inf when none)."""
        ordered = self._ordered.get(queue)
        return float(ordered[0][0]) if ordered else float("inf")

    def _order(self, e: Entry, sign: int) -> None:
        q = e.queue
        old = self._keys.pop(e.job_id, None)
        if old is not None:  # released (or admitted again without a release in between: the new admission counts)
            ordered = self._ordered[q]
            i = bisect_left(ordered, old)
            del ordered[i]
            del self._ids[q][i]
            del self._by_id[e.job_id]
            using = self._using[q]
            for r in self._uses.pop(e.job_id):
                using[r] -= 1
        if sign > 0 and e.preemptible and e.admitted is not None:
            key = (e.priority, -e.admitted.admitted_at, e.job_id)
            ordered = self._ordered.setdefault(q, [])
            i = bisect_left(ordered, key)
            ordered.insert(i, key)
            self._ids.setdefault(q, []).insert(i, e.job_id)
            self._keys[e.job_id] = key
            self._by_id[e.job_id] = e
            uses = self._uses[e.job_id] = tuple(r for r, n in e.admitted.usage.items() if n > 0)
            using = self._using.setdefault(q, {})
            for r in uses:
                using[r] = using.get(r, 0) + 1
