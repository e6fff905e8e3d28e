"""What every executor checks before it runs a placement (the simulated one and the Kubernetes one).

A JobPlaced is acted on only when it is the scheduler's current decision for the job: the scheduler recorded this
placement (same fencing token, same bindings) in its own table in the transaction that emitted the event, under a
term its leader lease really granted, and the job was not cancelled since. Anything else, a placement for a job
never admitted, one without or with a made-up fencing token, one superseded by a later placement, is refused and
dead-lettered with the reason (`shared.service.Refused`).

The executors read the scheduler's table read-only (like `gpuq status`): the scheduler stays the one owner of
placements, and the check needs no event that could itself be forged.

In a consumed batch the check's read is made once for the batch's placements (`placement_prefetch`, the runtime's
`ServiceSpec.prefetch` hook): each job's first message of the batch is answered from it, any other placement reads
its own row (an earlier message of the batch, a cancel for instance, may have changed what it would find).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from shared.events import CloudEvent, JobPlaced
from shared.service import Refused, first_messages_of_jobs

UNFENCED = "UnfencedPlacement"
UNKNOWN_JOB = "PlacementForUnknownJob"
STALE = "StalePlacement"
FORGED_TOKEN = "ForgedFencingToken"
CANCELLED = "PlacementOfCancelledJob"

SCRATCH_KEY = "executor-placement-lookup"
Prefetch = Callable[[asyncpg.Connection, Sequence[tuple[CloudEvent, Any, str]], dict[str, Any]], Awaitable[None]]


class SchedulerTables:
    """Whether the scheduler's tables were found in this executor's database (one per executor instance): from
    then on a check is one query (tables are never dropped while the platform runs)."""

    def __init__(self) -> None:
        self.seen = False


def _bindings_key(bindings: list[dict[str, object]]) -> list[tuple[str, str, tuple[int, ...], object]]:
    return sorted((str(b["pod"]), str(b["node"]), tuple(b.get("gpu_indices") or ()),  # type: ignore[arg-type]  # JSON list of ints
                   tuple(b["mig_slice"]) if b.get("mig_slice") else None) for b in bindings)  # type: ignore[arg-type]  # JSON pair


@dataclass(frozen=True)
class RunRow:
    """What an executor's own table says of the job's latest run, read with the check (`runs_table`)."""

    status: str
    done_s: float


async def read_placements(conn: asyncpg.Connection, job_ids: Sequence[str], *, cancelled_table: str,
                          runs_table: str | None = None) -> dict[str, asyncpg.Record]:
    """What the check reads of each job, in one statement: its tombstone here, the scheduler's current term, the
    scheduler's row of the job and (with `runs_table`) this executor's run of it. The scheduler's tables must
    exist (`SchedulerTables.seen`)."""
    run_columns, run_join = (", r.status AS run_status, r.done_s AS run_done_s",
                             f" LEFT JOIN {runs_table} r ON r.job_id = u.id") if runs_table else ("", "")
    rows = await conn.fetch(
        f"SELECT u.id, EXISTS (SELECT 1 FROM {cancelled_table} WHERE job_id = u.id) AS cancelled, "
        "(SELECT max(term) FROM scheduler.leader_terms) AS current, j.status, j.fencing_token, j.bindings, "
        f"j.job_id IS NOT NULL AS known{run_columns} "
        f"FROM unnest($1::text[]) AS u(id) LEFT JOIN scheduler.jobs j ON j.job_id = u.id{run_join}", list(job_ids))
    return {r["id"]: r for r in rows}


def placement_prefetch(tables: SchedulerTables, *, cancelled_table: str, runs_table: str | None = None) -> Prefetch:
    """`ServiceSpec.prefetch` for an executor: the check's read for every served placement of the batch, left in the
    batch's scratch for `verify_placement(..., scratch=)` (none while the scheduler's tables do not exist)."""
    async def prefetch(conn: asyncpg.Connection, messages: Sequence[tuple[CloudEvent, Any, str]],
                       scratch: dict[str, Any]) -> None:
        served = first_messages_of_jobs(messages, JobPlaced)
        if served and not tables.seen:  # the first batch after start: are the scheduler's tables there yet?
            tables.seen = all(await _scheduler_tables(conn))
        if served and tables.seen:
            scratch[SCRATCH_KEY] = await read_placements(conn, served, cancelled_table=cancelled_table,
                                                         runs_table=runs_table)
    return prefetch


async def _scheduler_tables(conn: asyncpg.Connection) -> tuple[bool, bool]:
    """Do scheduler.jobs and scheduler.leader_terms exist?"""
    row = await conn.fetchrow(
        "SELECT to_regclass('scheduler.jobs') IS NOT NULL, to_regclass('scheduler.leader_terms') IS NOT NULL")
    return bool(row[0]), bool(row[1])


def placement_prefetched(scratch: dict[str, Any], job_id: str) -> bool:
    """Does the batch's read hold this job's row (so that `verify_placement` reads nothing)?"""
    lookup = scratch.get(SCRATCH_KEY)
    return lookup is not None and job_id in lookup


async def verify_placement(conn: asyncpg.Connection, placed: JobPlaced, *, cancelled_table: str,
                           tables: SchedulerTables | None = None, runs_table: str | None = None,
                           scratch: dict[str, Any] | None = None) -> RunRow | None:
    """Raise Refused unless `placed` is the scheduler's current placement of a job still to run.
    `cancelled_table`: the executor's own record of jobs it heard were cancelled. `runs_table`: the executor's
    table of runs (columns job_id, status, done_s), whose row of the job the same read returns (None: no run yet,
    or no `runs_table`), so that checking a placement and finding its earlier run cost one round trip, not two.

    One round trip once the scheduler's tables exist (an executor runs before the scheduler ever did, e.g. on
    its own in tests: then the tables are looked up first, and refusals name what is missing); none where the
    batch's read (`scratch`, from `placement_prefetch`) holds the job's row."""
    job = placed.job_id
    lookup = scratch.get(SCRATCH_KEY) if scratch is not None else None
    row: asyncpg.Record | None = lookup.pop(job, None) if lookup is not None else None
    if placed.fencing_token is None:
        raise Refused(UNFENCED, f"JobPlaced for {job} carries no fencing token: only the scheduler's leader places")
    if tables is None or not tables.seen:
        has_jobs, has_terms = await _scheduler_tables(conn)
        if not (has_jobs and has_terms):
            if await conn.fetchval(f"SELECT true FROM {cancelled_table} WHERE job_id = $1", job):
                raise Refused(CANCELLED, f"job {job} was cancelled; its placement is not run")
            if not has_jobs:
                raise Refused(UNKNOWN_JOB, f"JobPlaced for {job}: the scheduler has recorded no placement at all "
                                           "here")
            raise Refused(FORGED_TOKEN, f"JobPlaced for {job} carries fencing token {placed.fencing_token}, but "
                                        "the scheduler's lease has granted no term")
        if tables is not None:
            tables.seen = True
    if row is None:
        row = (await read_placements(conn, [job], cancelled_table=cancelled_table, runs_table=runs_table))[job]
    if row["cancelled"]:
        raise Refused(CANCELLED, f"job {job} was cancelled; its placement is not run")
    if not row["known"]:
        raise Refused(UNKNOWN_JOB, f"JobPlaced for {job}, a job the scheduler never received from admission")
    current = row["current"]
    if current is None or placed.fencing_token > current:
        raise Refused(FORGED_TOKEN, f"JobPlaced for {job} carries fencing token {placed.fencing_token}, but the "
                                    f"scheduler's lease has granted terms up to {current} only")
    recorded = _bindings_key(json.loads(row["bindings"])) if row["bindings"] else None
    offered = _bindings_key([b.model_dump(mode="json") for b in placed.bindings])
    if row["status"] != "placed" or row["fencing_token"] != placed.fencing_token or recorded != offered:
        raise Refused(STALE, f"JobPlaced for {job} (token {placed.fencing_token}) is not the scheduler's current "
                             f"placement of it (status {row['status']}, token {row['fencing_token']})")
    if runs_table is None or row["run_status"] is None:
        return None
    return RunRow(status=row["run_status"], done_s=float(row["run_done_s"]))
