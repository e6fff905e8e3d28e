"""The admission cycle's messages for waiting jobs, written only when read.

A deep backlog gets a message per job every cycle, and most are replaced before anyone reads them: these objects
keep what the text needs and write it on first read. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.core.admission.quota import QueueQuota, QuotaBook
from services.core.admission.resources import GpuOption, gpu_capped


class LazyText:
    """A message written only when read, then kept. Most of a deep backlog's messages are never read
    before the next cycle replaces them, and writing them eagerly was a fifth of a cycle."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text: str | None = None

    def __str__(self) -> str:
        if self.text is None:
            self.text = self._write()
        return self.text

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __eq__(self, other: object) -> bool:
        return str(self) == (str(other) if isinstance(other, LazyText | str) else other)

    __hash__ = None  # type: ignore[assignment]  # compares by text, which may not be written yet

    def _write(self) -> str:
        raise NotImplementedError


def rewrite_when_read(message: object) -> None:
    """Forget a lazy message's text (and its base's), so that it is written again, from the numbers as they are
    then, when next read."""
    while isinstance(message, LazyText):
        message.text = None
        message = message.base if isinstance(message, Then) else None


class Why(LazyText):
    """Why a job does not fit, with the numbers of every option. The numbers are those of the cycle's end
    (the book and free capacity as the cycle left them; the statuses view that reads them is valid only
    until the state changes)."""

    __slots__ = ("book", "cap", "options", "qq", "taken")

    def __init__(self, book: QuotaBook, qq: QueueQuota, options: tuple[GpuOption, ...], taken: Mapping[str, int],
                 cap: Mapping[str, int] | None):
        super().__init__()
        self.book, self.qq, self.options, self.taken, self.cap = book, qq, options, taken, cap

    def _write(self) -> str:
        book, qq, cap, taken = self.book, self.qq, self.cap, self.taken
        q = qq.name
        parts = []
        for _m, r, amount in self.options:
            total = taken.get(r, 0) + amount
            used, nominal = book.used(q, r), qq.nominal[r]
            text = f"needs {total} {r}; {q} uses {used}/{nominal} {r}"
            if total <= book.available(qq, r) and cap is not None and gpu_capped(cap, r):
                text += f"; the cluster has {max(0, cap.get(r, 0))} {r} free"
            elif qq.cohort is None:
                text += " and has no cohort to borrow from"
            else:
                limit = qq.borrowing_limit[r]
                if limit is not None and used + total > nominal + limit:
                    text += f" and may borrow at most {limit}"
                text += f"; cohort {qq.cohort} has {max(0, book.cohort_available(qq.cohort, r))} lendable"
                if used + total <= nominal:
                    lent = sum(book.borrowed(o, r) for o in book.pool_members.get(qq.pool or '', ()) if o != q)
                    text += f", {lent} borrowed by other queues"
            parts.append(text)
        return " | ".join(parts)


class Then(LazyText):
    """`<base>; <suffix>`: a shared reason plus what this job's reclaim found."""

    __slots__ = ("base", "suffix")

    def __init__(self, base: str | LazyText, suffix: str):
        super().__init__()
        self.base, self.suffix = base, suffix

    def _write(self) -> str:
        return f"{self.base}; {self.suffix}"
