"""Which cohorts an admission instance serves, and what follows from that: its leases, its consumers, the queues
and jobs it owns (docs/admission.md, "Running several admission instances").

Cohorts share nothing in the admission core (borrowing and reclaim stay inside a cohort), so admission can run
as one active instance per cohort. Queues without a cohort, and queues the configuration does not (or no
longer) declare, belong to the pseudo-cohort `-`. An instance that serves all cohorts (the default) owns
everything, whatever the configuration says, and behaves exactly like the single admission instance.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from shared.config import QueuesConfig
from shared.settings import settings

NO_COHORT = "-"  # the pseudo-cohort of queues without a cohort (and of unknown or deleted queues)
ENV_VAR = "GPUQ_ADMISSION_COHORTS"
LEASE_SCOPE = "admission"  # exclusive for an all-cohorts instance, shared by the per-cohort ones
_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")
_MAX_READABLE_SUFFIX = 48


def parse_cohorts(text: str | None) -> tuple[str, ...]:
    """'b, a,,a' -> ('a', 'b'). Empty (or None) = all cohorts."""
    return tuple(sorted({part.strip() for part in (text or "").split(",") if part.strip()}))


def cohorts_from_env() -> tuple[str, ...]:
    return settings().admission_cohorts


@dataclass(frozen=True)
class Shard:
    """The cohorts one admission instance serves; `cohorts` None = all of them."""

    cohorts: frozenset[str] | None = None

    @classmethod
    def of(cls, cohorts: Iterable[str] | str | None) -> Shard:
        if isinstance(cohorts, str):
            cohorts = parse_cohorts(cohorts)
        names = frozenset(c.strip() for c in cohorts or () if c.strip())
        return cls(names or None)

    @property
    def serves_all(self) -> bool:
        return self.cohorts is None

    def describe(self) -> str:
        return "all cohorts" if self.cohorts is None else "cohorts " + ", ".join(sorted(self.cohorts))

    # ------------------------------------------------------------------ ownership

    def owns_queue(self, config: QueuesConfig, queue: str) -> bool:
        if self.cohorts is None:
            return True
        return cohort_of(config, queue) in self.cohorts

    def queues(self, config: QueuesConfig) -> list[str]:
        """The configured queues this instance owns, sorted."""
        return sorted(q.name for q in config.queues
                      if self.cohorts is None or cohort_of(config, q.name) in self.cohorts)

    @property
    def owns_unknown_queues(self) -> bool:
        """Jobs of queues the configuration does not declare (rejected, or kept after a queue was deleted)."""
        return self.cohorts is None or NO_COHORT in self.cohorts

    # ------------------------------------------------------------------ runtime settings

    @property
    def consumer_suffix(self) -> str:
        """Durable consumer names per cohort set: '' for all cohorts (the names of the single instance),
        '-c-a+b' for cohorts a and b; a hash when the names are long or not safe in a consumer name."""
        if self.cohorts is None:
            return ""
        names = sorted(self.cohorts)
        joined = "+".join(names)
        if len(joined) <= _MAX_READABLE_SUFFIX and all(_SAFE.match(n) for n in names):
            return f"-c-{joined}"
        return "-c-" + hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]

    @property
    def lease_scopes(self) -> tuple[str, ...]:
        """Exclusive leases, sorted: one per cohort ('admission/<cohort>'), or none for all cohorts (the
        runtime's default lease, 'admission', exclusive)."""
        if self.cohorts is None:
            return ()
        return tuple(f"{LEASE_SCOPE}/{c}" for c in sorted(self.cohorts))

    @property
    def shared_lease_scopes(self) -> tuple[str, ...]:
        """Per-cohort instances hold 'admission' in shared mode: they run side by side, but never while an
        all-cohorts instance (which holds it exclusively) runs, and it never while one of them runs."""
        return () if self.cohorts is None else (LEASE_SCOPE,)


def cohort_of(config: QueuesConfig, queue: str) -> str:
    """The shard of a queue: the root of its cohort tree (quota is shared across the whole tree), or `-`."""
    q = config.queue_map.get(queue)
    root = config.cohort_root(q.cohort) if q is not None else None
    return root if root is not None else NO_COHORT
