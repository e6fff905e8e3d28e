"""Rollups: allocation parts and hourly usage → per (dimensions, period) totals, costs and the demo's table.

Inputs are the ledger's rows (integers); outputs are plain figures. The window is aligned to whole hours
(usage is stored per hour), allocation time is clipped to it exactly, and an allocation that has not ended
yet counts until `horizon_ms` (the latest instant the ledger has heard of, or the caller's `now`).

Idle-allocated time (waste) is `max(0, allocated − used)` per (job, GPU model, hour): computed at that fine
grain before summing so that one job's over-sampled hour never hides another job's idle one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from services.core.metering.units import DAY_MS, HOUR_MS, ceil_to, floor_to

UNKNOWN = "(unknown)"  # a dimension of a job metering has samples for but no placement yet
NONE = "(none)"  # a label the job does not carry
DEFAULT_RATE = 1.0  # shared.config.GpuFlavor's default cost_per_gpu_hour, for models without a price

# Built-in dimensions; any other name is read from the job's labels (feature, project, ...).
JOB_DIMENSIONS = ("job", "team", "queue", "priority_class", "kind", "user")
ALL_DIMENSIONS = (*JOB_DIMENSIONS, "gpu_model")


class Granularity(StrEnum):
    TOTAL = "total"
    HOUR = "hour"
    DAY = "day"


@dataclass(frozen=True)
class JobDims:
    job_id: str
    team: str = UNKNOWN
    queue: str = UNKNOWN
    priority_class: str = UNKNOWN
    kind: str = UNKNOWN
    user: str = NONE
    labels: tuple[tuple[str, str], ...] = ()

    def value(self, dimension: str) -> str:
        if dimension == "job":
            return self.job_id
        if dimension in JOB_DIMENSIONS:
            return str(getattr(self, dimension))
        key = dimension.removeprefix("label:")
        return dict(self.labels).get(key, NONE)

    def tags(self) -> dict[str, str]:
        out = {"team": self.team, "queue": self.queue, "priority_class": self.priority_class, "kind": self.kind}
        out.update(dict(self.labels))
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class AllocationRow:
    job_id: str
    gpu_model: str
    milli_gpus: int
    placed_at_ms: int
    ended_at_ms: int | None
    lost_ms: int = 0


@dataclass(frozen=True)
class UsageRow:
    job_id: str
    gpu_model: str
    hour_ms: int
    used_gpu_ms: int
    sampled_gpu_ms: int = 0
    energy_mj: int = 0
    samples: int = 0


@dataclass
class Totals:
    allocated_gpu_ms: int = 0
    used_gpu_ms: int = 0
    idle_gpu_ms: int = 0
    lost_gpu_ms: int = 0
    sampled_gpu_ms: int = 0
    energy_mj: int = 0
    samples: int = 0
    cost: float = 0.0
    idle_cost: float = 0.0
    jobs: set[str] = field(default_factory=set)
    held_milli: int = 0  # the most milli-GPUs held at once by one placement (a job sharing a GPU: its fraction)

    def add(self, other: Totals) -> None:
        self.allocated_gpu_ms += other.allocated_gpu_ms
        self.used_gpu_ms += other.used_gpu_ms
        self.idle_gpu_ms += other.idle_gpu_ms
        self.lost_gpu_ms += other.lost_gpu_ms
        self.sampled_gpu_ms += other.sampled_gpu_ms
        self.energy_mj += other.energy_mj
        self.samples += other.samples
        self.cost += other.cost
        self.idle_cost += other.idle_cost
        self.jobs |= other.jobs
        self.held_milli = max(self.held_milli, other.held_milli)


@dataclass(frozen=True)
class Cell:
    """The finest grain: one job on one GPU model in one hour."""

    job_id: str
    gpu_model: str
    hour_ms: int
    allocated_gpu_ms: int
    used_gpu_ms: int
    lost_gpu_ms: int
    sampled_gpu_ms: int
    energy_mj: int
    samples: int
    # The most milli-GPUs one placement of the job held on that model in the hour (its parts on every node added
    # up): 250 for a pod holding a quarter of a shared GPU, 8000 for 8 whole GPUs.
    held_milli: int = 0

    @property
    def idle_gpu_ms(self) -> int:
        return max(0, self.allocated_gpu_ms - self.used_gpu_ms)


@dataclass(frozen=True)
class RollupRow:
    key: tuple[str, ...]  # one value per dimension asked for, in the order asked
    period_start_ms: int
    period_end_ms: int
    totals: Totals


def aligned_window(since_ms: int, until_ms: int) -> tuple[int, int]:
    """The window widened to whole hours: usage is kept per hour, so partial hours cannot be split."""
    return floor_to(since_ms, HOUR_MS), ceil_to(until_ms, HOUR_MS)


def split_hours(start_ms: int, end_ms: int) -> list[tuple[int, int]]:
    """(hour start, milliseconds inside that hour) for the interval [start, end)."""
    out: list[tuple[int, int]] = []
    t = start_ms
    while t < end_ms:
        hour = floor_to(t, HOUR_MS)
        nxt = min(end_ms, hour + HOUR_MS)
        out.append((hour, nxt - t))
        t = nxt
    return out


def build_cells(allocations: Iterable[AllocationRow], usage: Iterable[UsageRow], *, since_ms: int,
                until_ms: int, horizon_ms: int) -> list[Cell]:
    """Per (job, model, hour) figures inside the hour-aligned window, sorted."""
    since_ms, until_ms = aligned_window(since_ms, until_ms)
    acc: dict[tuple[str, str, int], list[int]] = {}
    held: dict[tuple[str, str, int, int], int] = {}  # (job, model, hour, placed at) -> milli-GPUs of that placement

    def slot(job: str, model: str, hour: int) -> list[int]:
        return acc.setdefault((job, model, hour), [0, 0, 0, 0, 0, 0, 0])

    for a in allocations:
        end = a.ended_at_ms if a.ended_at_ms is not None else max(a.placed_at_ms, horizon_ms)
        start, stop = max(a.placed_at_ms, since_ms), min(end, until_ms)
        for hour, ms in split_hours(start, stop):
            slot(a.job_id, a.gpu_model, hour)[0] += a.milli_gpus * ms // 1000
            key = (a.job_id, a.gpu_model, hour, a.placed_at_ms)
            held[key] = held.get(key, 0) + a.milli_gpus
        # Lost work belongs to the hour the job was preempted in.
        if a.lost_ms and a.ended_at_ms is not None and since_ms <= a.ended_at_ms < until_ms:
            slot(a.job_id, a.gpu_model, floor_to(a.ended_at_ms, HOUR_MS))[2] += a.lost_ms
    for u in usage:
        if since_ms <= u.hour_ms < until_ms:
            s = slot(u.job_id, u.gpu_model, u.hour_ms)
            s[1] += u.used_gpu_ms
            s[3] += u.sampled_gpu_ms
            s[4] += u.energy_mj
            s[5] += u.samples
    for (job, model, hour, _), milli in held.items():
        s = acc[(job, model, hour)]
        s[6] = max(s[6], milli)
    return [Cell(job, model, hour, *vals) for (job, model, hour), vals in sorted(acc.items())]


def _period(hour_ms: int, granularity: Granularity, since_ms: int, until_ms: int) -> tuple[int, int]:
    if granularity is Granularity.HOUR:
        return hour_ms, hour_ms + HOUR_MS
    if granularity is Granularity.DAY:
        day = floor_to(hour_ms, DAY_MS)
        return day, day + DAY_MS
    return aligned_window(since_ms, until_ms)


def rollup(cells: Sequence[Cell], dims: Mapping[str, JobDims], *, by: Sequence[str],
           granularity: Granularity = Granularity.TOTAL, since_ms: int, until_ms: int,
           rates: Mapping[str, float] | None = None, default_rate: float = DEFAULT_RATE) -> list[RollupRow]:
    """Group cells by the asked dimensions and period; cost = allocated GPU-hours × the model's rate."""
    rates = rates or {}
    groups: dict[tuple[tuple[str, ...], int, int], Totals] = {}
    for c in sorted(cells, key=lambda c: (c.job_id, c.gpu_model, c.hour_ms)):
        job = dims.get(c.job_id) or JobDims(c.job_id)
        key = tuple(c.gpu_model if d == "gpu_model" else job.value(d) for d in by)
        start, end = _period(c.hour_ms, granularity, since_ms, until_ms)
        t = groups.setdefault((key, start, end), Totals())
        rate = rates.get(c.gpu_model, default_rate)
        t.add(Totals(allocated_gpu_ms=c.allocated_gpu_ms, used_gpu_ms=c.used_gpu_ms,
                     idle_gpu_ms=c.idle_gpu_ms, lost_gpu_ms=c.lost_gpu_ms, sampled_gpu_ms=c.sampled_gpu_ms,
                     energy_mj=c.energy_mj, samples=c.samples, jobs={c.job_id}, held_milli=c.held_milli,
                     cost=c.allocated_gpu_ms * rate / HOUR_MS, idle_cost=c.idle_gpu_ms * rate / HOUR_MS))
    return [RollupRow(key, start, end, t) for (key, start, end), t in sorted(groups.items())]


def grand_total(rows: Iterable[RollupRow]) -> Totals:
    total = Totals()
    for r in rows:
        total.add(r.totals)
    return total


def team_summary_table(allocations: Iterable[AllocationRow], usage: Iterable[UsageRow],
                       dims: Mapping[str, JobDims], *, horizon_ms: int,
                       rates: Mapping[str, float] | None = None,
                       default_rate: float = DEFAULT_RATE) -> list[dict[str, object]]:
    """The demo's final table: per team allocated, used, idle GPU-hours and cost, over the whole ledger."""
    allocations, usage = list(allocations), list(usage)
    starts = [a.placed_at_ms for a in allocations] + [u.hour_ms for u in usage]
    ends = [a.ended_at_ms or horizon_ms for a in allocations] + [u.hour_ms + HOUR_MS for u in usage]
    if not starts:
        return []
    since, until = min(starts), max([*ends, horizon_ms])
    cells = build_cells(allocations, usage, since_ms=since, until_ms=until, horizon_ms=horizon_ms)
    rows = rollup(cells, dims, by=("team",), since_ms=since, until_ms=until, rates=rates,
                  default_rate=default_rate)
    return [
        {
            "team": r.key[0],
            "jobs": len(r.totals.jobs),
            "allocated_gpu_hours": round(r.totals.allocated_gpu_ms / HOUR_MS, 4),
            "used_gpu_hours": round(r.totals.used_gpu_ms / HOUR_MS, 4),
            "idle_gpu_hours": round(r.totals.idle_gpu_ms / HOUR_MS, 4),
            "lost_gpu_hours": round(r.totals.lost_gpu_ms / HOUR_MS, 4),
            "cost": round(r.totals.cost, 2),
        }
        for r in rows
    ]
