"""`PendingStatuses`: a cycle's status of every pending job, built when read instead of during the cycle.

A cycle leaves each pending entry its reason and message; its positions (in its queue, and in its cohort: the
cohort's jobs merged in queue order) follow from the sorted pending lists. Building 50,000 PendingStatus objects
and both positions on every cycle was more than half of a cycle with a deep backlog, while most callers read a
few statuses (`gpuq explain`, tests) or walk them once (the service, to publish the ones that changed).

So the view keeps the cycle's sorted lists (copied: later submissions must not appear in it) and reads the
entries when asked: one status costs a binary search per queue of its cohort, a full walk costs one merge per
cohort. Entries are rewritten by the next cycle and removed by finish(), so the view is valid only until the
state changes; reading it later raises instead of answering with another cycle's reasons. Callers that keep
statuses copy them first (`dict(decision.pending)`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

from services.core.admission.model import PendingStatus

if TYPE_CHECKING:
    from services.core.admission.entry import Entry
    from services.core.admission.state import AdmissionState

_order = attrgetter("order")


def message_text(message: object) -> str:
    """A status message as text: the cycle may leave an object that writes its text when first read."""
    return message if type(message) is str else str(message)


_text = message_text


class StalePendingStatuses(RuntimeError):
    """A cycle's PendingStatuses was read after the admission state changed."""


class PendingStatuses(Mapping[str, PendingStatus]):
    """job_id -> PendingStatus for the jobs pending after a cycle, in scope order then cohort order."""

    __slots__ = ("_by_queue", "_generation", "_judged", "_scopes", "_settled", "_state")

    def __init__(self, state: AdmissionState | None, scopes: dict[str, list[list[Entry]]],
                 judged: frozenset[str] | None = None, settled: frozenset[str] = frozenset()):
        self._state = state
        # scopes this cycle judged again; the others were reused unchanged from an earlier cycle
        self._judged = frozenset(scopes) if judged is None else judged
        # queues (in judged scopes) whose statuses are the last cycle's but for the numbers in their messages
        self._settled = settled
        self._generation = state.generation if state is not None else 0
        self._scopes = scopes  # scope -> its queues' pending lists (sorted, copies)
        self._by_queue: dict[str, tuple[list[Entry], list[list[Entry]]]] = {
            lst[0].queue: (lst, lists) for lists in scopes.values() for lst in lists}

    @classmethod
    def empty(cls) -> PendingStatuses:
        return cls(None, {})

    def _check(self) -> None:
        if self._state is not None and self._state.generation != self._generation:
            raise StalePendingStatuses(
                "these pending statuses belong to an earlier admission cycle and the state has changed since; "
                "copy them (dict(decision.pending)) before changing the state")

    def _locate(self, job_id: str) -> tuple[Entry, list[Entry], list[list[Entry]], int] | None:
        state = self._state
        if state is None:
            return None
        e = state.entry(job_id)
        if e is None or e.admitted is not None:
            return None
        found = self._by_queue.get(e.queue)
        if found is None:
            return None
        lst, lists = found
        i = bisect_left(lst, e.order, key=_order)
        if i == len(lst) or lst[i] is not e:
            return None
        return e, lst, lists, i

    def __getitem__(self, job_id: str) -> PendingStatus:
        self._check()
        found = self._locate(job_id)
        if found is None:
            raise KeyError(job_id)
        e, _lst, lists, i = found
        return PendingStatus(e.job_id, e.queue, e.reason, _text(e.message), i + 1, _cohort_position(e, lists))

    def __contains__(self, job_id: object) -> bool:
        self._check()
        return isinstance(job_id, str) and self._locate(job_id) is not None

    def __iter__(self) -> Iterator[str]:
        self._check()
        for sc in sorted(self._scopes):
            for e in self._merged(self._scopes[sc]):
                yield e.job_id

    def __len__(self) -> int:
        return sum(len(lst) for lists in self._scopes.values() for lst in lists)

    def items(self) -> Iterator[tuple[str, PendingStatus]]:  # type: ignore[override]  # lazy: an iterator, not a view
        """Every status, computed in one pass per cohort (a merge), not one search per job.

        Statuses are built without the frozen dataclass __init__ (six object.__setattr__ calls behind
        frozen checks, a third of a walk over 50,000 jobs); the slot setters store exactly what __init__
        would, so eq, hash and repr are the same."""
        return self._items(sorted(self._scopes))

    def _items(self, scopes: list[str]) -> Iterator[tuple[str, PendingStatus]]:
        new = object.__new__
        cls = PendingStatus
        set_job, set_queue, set_reason, set_message, set_qpos, set_cpos = _STATUS_SETTERS
        for e, qpos, cpos in self._ranked(scopes):
            st = new(cls)
            set_job(st, e.job_id)
            set_queue(st, e.queue)
            set_reason(st, e.reason)
            set_message(st, _text(e.message))
            set_qpos(st, qpos)
            set_cpos(st, cpos)
            yield e.job_id, st

    def _ranked(self, scopes: list[str]) -> Iterator[tuple[Entry, int, int]]:
        """(entry, position in queue, position in cohort) for the given scopes, in scope then cohort order."""
        self._check()
        for sc in scopes:
            lists = self._scopes[sc]
            if len(lists) == 1:  # one queue with pending jobs in its scope: its order is the cohort's
                for pos, e in enumerate(lists[0], 1):
                    yield e, pos, pos
                continue
            # Each list is one queue's, sorted, and order keys are unique (they end with the job id): the merge
            # meets a queue's jobs in its own order, so a count per queue is each job's position in its queue.
            qpos = dict.fromkeys((lst[0].queue for lst in lists), 0)
            for cpos, e in enumerate(self._merged(lists), 1):
                q = e.queue
                n = qpos[q] + 1
                qpos[q] = n
                yield e, n, cpos

    def judged_items(self) -> Iterator[tuple[str, PendingStatus]]:
        """`items()` of the cohorts this cycle judged again. The other cohorts' statuses are exactly those of
        the earlier cycle that computed them (nothing changed there), so a caller that already handled that
        cycle's statuses (the service, publishing what changed) can skip them: a cycle then costs the caller
        O(pending in the cohorts that changed), not O(all pending)."""
        return self._items(self._judged_scopes())

    def _judged_scopes(self) -> list[str]:
        return sorted(sc for sc in self._scopes if sc in self._judged)

    def judged_rows(self, *, settled: bool = False) -> Iterator[tuple[str, str, str, object, int, int]]:
        """(job_id, queue, reason, message, position in queue, position in cohort) of the cohorts this cycle
        judged again, without building PendingStatus objects and without writing the messages: `message` may
        be an object whose `str()` writes the text (`message_text`). For a caller that looks at reasons and
        positions first and reads a message only when it needs it.

        Left out unless `settled`: the queues whose jobs kept their reasons and positions since the last cycle
        (a queue at its hard cap that nothing changed; reuse.py, "sealed queues"), where only the cohort's
        numbers in the messages moved. A caller that rewrites such numbers now and then asks for them then.
        Rows come in scope order, then cohort order (queue by queue in a scope where some are left out)."""
        skip = frozenset() if settled else self._settled
        for sc in self._judged_scopes():
            lists = self._scopes[sc]
            if not skip or not any(lst[0].queue in skip for lst in lists):
                for e, qpos, cpos in self._ranked([sc]):
                    yield e.job_id, e.queue, e.reason, e.message, qpos, cpos
                continue
            self._check()
            for lst in lists:
                if lst[0].queue in skip:
                    continue
                for qpos, e in enumerate(lst, 1):
                    yield e.job_id, e.queue, e.reason, e.message, qpos, _cohort_position(e, lists)

    def values(self) -> Iterator[PendingStatus]:  # type: ignore[override]  # lazy: an iterator, not a view
        return (st for _, st in self.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]  # mutable-looking mapping: unhashable, as dict

    def __repr__(self) -> str:
        return f"PendingStatuses({len(self)} jobs)"

    @staticmethod
    def _merged(lists: list[list[Entry]]) -> list[Entry]:
        if len(lists) == 1:
            return lists[0]
        return sorted(chain.from_iterable(lists), key=_order)


def _cohort_position(e: Entry, lists: list[list[Entry]]) -> int:
    """1 + the number of jobs of its cohort's pending lists (its own included) ordered before `e`."""
    return 1 + sum(bisect_left(other, e.order, key=_order) for other in lists)


_STATUS_SETTERS = tuple(getattr(PendingStatus, f).__set__ for f in (
    "job_id", "queue", "reason", "message", "position_in_queue", "position_in_cohort"))
