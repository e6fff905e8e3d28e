"""A consumed batch's job rows, read and written once for the batch (docs/scheduler.md, "Batch-end writes").

Each `JobAdmitted` asked Postgres, in one round trip of its own, whether the job was cancelled first and what its
row said, and each `JobStarted` and end of a job wrote its row in one more: in a steady stream of jobs those were
three statements per job, against about six per batch for everything else the scheduler does. A batch of 100
admissions waited for 100 answers in turn before its scheduling cycle could place any of them.

Now:
- **Reads.** The runtime's `ServiceSpec.prefetch` hook calls `prefetch_admissions` once per attempt at a batch,
  before its first handler: one statement reads the tombstone and row of every admitted job the batch's start can
  answer truly, each job's first message of the batch (`shared.service.first_messages_of_jobs`; node and
  heartbeat events touch no job's row). Any other admission reads its own.
- **Writes.** A handler makes its row changes through `record`, which holds them in the unit of work's scratch
  (`HeldRows`) only where any failure rolls the whole transaction back (`Tx.may_hold_rows`) and elsewhere writes them
  at once with the same statements; `write_held` writes each kind in one `unnest` statement: at the start of the
  scheduling cycle (whose placement update needs the rows), before any handler's own statement on the tables, and
  after the batch's events for a batch without a cycle. A crash or a failure before the commit loses the held rows
  with everything else of the batch, its inbox rows included, so the redelivered messages are handled again, once; the
  runtime rebuilds memory from the tables (`reload`).

Each statement keeps the condition the per-message one had before (no waiting row for a cancelled job or over a placed
one; a start only of a placed job), so it changes exactly the rows those would have. The kinds are written in the
order a job's life takes them (admitted, started, finished); the one change that could come before one already held,
an admission after the job's start or end in the same batch, is not served by the batch's read and reads its row
itself, which writes the held rows first. A start after an end is no change (the job is no longer placed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from shared.events import CloudEvent, ExecutorHeartbeat, JobAdmitted, NodeChanged, NodeInventory
from shared.service import Tx, first_messages_of_jobs

SCRATCH_KEY = "scheduler-held-rows"
LOOKUP_KEY = "scheduler-admission-lookup"
AFTER_EVENTS_KEY = "scheduler-held"  # the deferred work that writes what is left (sorts before "scheduling-cycle")

# Events that touch no job's row in the scheduler's tables: a lookup made at the batch's start stays true past them.
_NO_JOB_ROW = (NodeInventory, NodeChanged, ExecutorHeartbeat)


@dataclass(frozen=True)
class AdmissionLookup:
    """What the tables say of an admitted job before its admission is applied."""

    cancelled: bool  # a tombstone: the job was cancelled before its admission arrived
    status: str | None  # its row's status (None: no row)
    resume_from: str | None
    reason: str | None
    message: str | None
    planned_start: float | None


@dataclass
class HeldRows:
    # job id -> (spec JSON, flavors JSON, admitted at) of jobs that now wait (an insert, or a re-admission's update)
    admitted: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    # job id -> started at, of placed jobs (the expected end is the start plus the spec's max_runtime_s)
    started: dict[str, float] = field(default_factory=dict)
    # job id -> when it was cancelled (a tombstone besides the end), or None: an end
    finished: dict[str, float | None] = field(default_factory=dict)

    def admit(self, payload: JobAdmitted) -> None:
        self.admitted[payload.job_id] = (payload.spec.model_dump_json(), json.dumps(payload.flavors),
                                         payload.admitted_at.timestamp())

    def start(self, job_id: str, started_at: float) -> None:
        self.started[job_id] = started_at

    def finish(self, job_id: str, cancelled_at: float | None) -> None:
        if self.finished.get(job_id) is None:  # a cancel's tombstone stays, whatever end came after it
            self.finished[job_id] = cancelled_at


async def prefetch_admissions(conn: asyncpg.Connection, messages: Sequence[tuple[CloudEvent, Any, str]],
                              scratch: dict[str, Any]) -> None:
    """`ServiceSpec.prefetch` for the scheduler: every served admission's tombstone and row in one statement, left
    in `scratch` for `take`."""
    served = first_messages_of_jobs(messages, JobAdmitted, touching_no_job=_NO_JOB_ROW)
    if served:
        scratch[LOOKUP_KEY] = await read_admissions(conn, served)


async def read_admissions(conn: asyncpg.Connection, job_ids: Sequence[str]) -> dict[str, AdmissionLookup]:
    rows = await conn.fetch(
        "SELECT u.id, EXISTS (SELECT 1 FROM scheduler.cancelled c WHERE c.job_id = u.id) AS cancelled, "
        "j.status, j.resume_from, j.reason, j.message, j.planned_start "
        "FROM unnest($1::text[]) AS u(id) LEFT JOIN scheduler.jobs j ON j.job_id = u.id", list(job_ids))
    return {r["id"]: AdmissionLookup(cancelled=r["cancelled"], status=r["status"], resume_from=r["resume_from"],
                                     reason=r["reason"], message=r["message"], planned_start=r["planned_start"])
            for r in rows}


def take(scratch: dict[str, Any], job_id: str) -> AdmissionLookup | None:
    """The prefetched lookup of this admission, once; None: not prefetched, ask Postgres."""
    lookup = scratch.get(LOOKUP_KEY)
    return None if lookup is None else lookup.pop(job_id, None)


async def record(tx: Tx, change: Callable[[HeldRows], None]) -> None:
    """Make a change to job rows: held for the batch's end where rows may wait for it (`Tx.may_hold_rows`), else
    written at once, after whatever the batch held."""
    if tx.may_hold_rows:
        change(tx.scratch.setdefault(SCRATCH_KEY, HeldRows()))
        await tx.after_events(AFTER_EVENTS_KEY, write_held)
        return
    await write_held(tx)
    rows = HeldRows()
    change(rows)
    await _write(tx, rows)


async def write_held(tx: Tx) -> None:
    """Write the held rows (if any) and forget them."""
    rows = tx.scratch.pop(SCRATCH_KEY, None)
    if isinstance(rows, HeldRows):
        await _write(tx, rows)


async def _write(tx: Tx, rows: HeldRows) -> None:
    if rows.admitted:
        specs, flavors, at = (list(c) for c in zip(*rows.admitted.values(), strict=True))
        await tx.conn.execute(
            "INSERT INTO scheduler.jobs(job_id, spec, flavors, status, admitted_at) "
            "SELECT u.j, u.s::jsonb, u.f::jsonb, 'waiting', u.a "
            "FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS u(j, s, f, a) "
            "WHERE NOT EXISTS (SELECT 1 FROM scheduler.cancelled c WHERE c.job_id = u.j) "
            "ON CONFLICT (job_id) DO UPDATE SET spec = excluded.spec, flavors = excluded.flavors, status = 'waiting', "
            "admitted_at = excluded.admitted_at, bindings = NULL, placed_at = NULL "
            "WHERE scheduler.jobs.status <> 'placed'", list(rows.admitted), specs, flavors, at)
    if rows.started:
        await tx.conn.execute(
            "UPDATE scheduler.jobs AS j SET started_at = u.s, "
            "expected_end = u.s + (j.spec->>'max_runtime_s')::double precision "
            "FROM unnest($1::text[], $2::float8[]) AS u(id, s) WHERE j.job_id = u.id AND j.status = 'placed'",
            list(rows.started), list(rows.started.values()))
    if rows.finished:
        await tx.conn.execute("UPDATE scheduler.jobs SET status = 'finished' WHERE job_id = ANY($1::text[])",
                              list(rows.finished))
        cancelled = sorted((job, at) for job, at in rows.finished.items() if at is not None)
        if cancelled:
            await tx.conn.execute(
                "INSERT INTO scheduler.cancelled(job_id, at) SELECT * FROM unnest($1::text[], $2::float8[]) "
                "ON CONFLICT DO NOTHING", [j for j, _ in cancelled], [a for _, a in cancelled])

