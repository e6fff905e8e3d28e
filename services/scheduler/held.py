"""A consumed batch's job rows, read and written once for the batch (docs/scheduler.md, "Batch-end writes").

Each `JobAdmitted` asked Postgres, in one round trip of its own, whether the job was cancelled first and what its
row said, and each `JobStarted` and end of a job wrote its row in one more: in a steady stream of jobs those were
three statements per job, against about six per batch for everything else the scheduler does. A batch of 100
admissions waited for 100 answers in turn before its scheduling cycle could place any of them.

Now:
- **Reads.** The runtime's `ServiceSpec.prefetch` hook calls `prefetch_admissions` once per attempt at a batch,
  before its first handler: one statement reads the tombstone and row of every admitted job the batch's start can
  answer truly, each job's first message of the batch (`served_admissions`). Any other admission reads its own.
- **Writes.** A handler holds its row changes in the unit of work's scratch (`HeldRows`) only where any failure rolls
  the whole transaction back (`Tx.own_savepoint` false, in a consumed batch); `write_held` writes each kind in one
  `unnest` statement: at the start of the scheduling cycle (whose placement update needs the rows), before any
  handler's own statement on the tables, and after the batch's events for a batch without a cycle. A crash or a
  failure before the commit loses the held rows with everything else of the batch, its inbox rows included, so the
  redelivered messages are handled again, once; the runtime rebuilds memory from the tables (`reload`).

Each statement keeps the condition the per-message one had (no waiting row for a cancelled job or over a placed one;
a start only of a placed job), so it changes exactly the rows those would have. The kinds are written in the order
a job's life takes them (admitted, started, finished); the one change that could come before one already held, an
admission after the job's start or end in the same batch, is not served by the batch's read and reads its row
itself, which writes the held rows first. A start after an end is no change (the job is no longer placed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from shared.events import CloudEvent, ExecutorHeartbeat, JobAdmitted, NodeChanged, NodeInventory
from shared.service import Tx

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


def served_admissions(messages: Sequence[tuple[CloudEvent, Any, str]]) -> list[str]:
    """The admitted jobs a lookup made at the batch's start answers truly, in batch order: each job's first message
    of the batch, up to the first event that could touch rows of jobs it does not name."""
    mentioned: set[str] = set()
    served: list[str] = []
    for event, payload, _subject in messages:
        if isinstance(payload, _NO_JOB_ROW):
            continue
        about = getattr(payload, "job_id", None) or event.subject
        if not isinstance(about, str) or not about:
            break  # about no one job: what it changes is not known here
        if isinstance(payload, JobAdmitted) and about not in mentioned:
            served.append(about)
        mentioned.add(about)
    return served


async def prefetch_admissions(conn: asyncpg.Connection, messages: Sequence[tuple[CloudEvent, Any, str]],
                              scratch: dict[str, Any]) -> None:
    """`ServiceSpec.prefetch` for the scheduler: every served admission's tombstone and row in one statement, left
    in `scratch` for `take`."""
    served = served_admissions(messages)
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


def may_hold(tx: Tx) -> bool:
    """Rows may wait for the batch's end only where any failure rolls the whole transaction back."""
    return tx.deferred is not None and not tx.own_savepoint


async def hold(tx: Tx) -> HeldRows:
    """The batch's held rows, written after its events if nothing writes them before."""
    rows: HeldRows = tx.scratch.setdefault(SCRATCH_KEY, HeldRows())
    await tx.after_events(AFTER_EVENTS_KEY, write_held)
    return rows


async def write_held(tx: Tx) -> None:
    """Write the held rows (if any) and forget them."""
    rows = tx.scratch.pop(SCRATCH_KEY, None)
    if not isinstance(rows, HeldRows):
        return
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


def admitted_row(payload: JobAdmitted) -> tuple[str, str, float]:
    return payload.spec.model_dump_json(), json.dumps(payload.flavors), payload.admitted_at.timestamp()
