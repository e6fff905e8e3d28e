"""Rows of queued submissions held for the end of a batch (docs/admission.md, "Batch-end writes of queued
submissions"): a batch of submissions writes its `admission.jobs` and `admission.submissions` rows in two
statements instead of two per job.

A handler holds them in the unit of work's scratch (`Tx.scratch`) only where any failure rolls the whole transaction
back (`Tx.own_savepoint` false); whatever reads or writes those tables next in the same transaction (another
handler, the admission cycle) writes them first, so it sees every job the batch queued before it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.service import Tx

SCRATCH_KEY = "admission-held-submissions"


@dataclass
class HeldSubmissions:
    # job id -> (team, queue, spec JSON, received at, predicted GPU-seconds), in the order the jobs arrived
    jobs: dict[str, tuple[str, str, str, float, float | None]] = field(default_factory=dict)
    # (event id, job id, team, at) of each queued verdict
    verdicts: list[tuple[str, str, str, float]] = field(default_factory=list)


def held_rows(tx: Tx) -> HeldSubmissions | None:
    found = tx.scratch.get(SCRATCH_KEY)
    return found if isinstance(found, HeldSubmissions) else None


def hold_rows(tx: Tx) -> HeldSubmissions:
    rows: HeldSubmissions = tx.scratch.setdefault(SCRATCH_KEY, HeldSubmissions())
    return rows


async def write_held(tx: Tx) -> None:
    """Write the held rows (if any), in arrival order, and forget them."""
    rows = tx.scratch.pop(SCRATCH_KEY, None)
    if not isinstance(rows, HeldSubmissions) or not rows.jobs:
        return
    jobs = list(rows.jobs)
    columns = [list(c) for c in zip(*rows.jobs.values(), strict=True)]
    await tx.conn.execute(
        "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, predicted_gpu_s) "
        "SELECT j, t, q, s::jsonb, 'pending', a, p FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], "
        "$5::float8[], $6::float8[]) WITH ORDINALITY AS u(j, t, q, s, a, p, n) ORDER BY n",
        jobs, *columns)
    events, job_ids, teams, ats = (list(c) for c in zip(*rows.verdicts, strict=True))
    await tx.conn.execute(
        "INSERT INTO admission.submissions(event_id, job_id, team, verdict, at) "
        "SELECT e, j, t, 'queued', a FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS u(e, j, t, a) "
        "ON CONFLICT (event_id) DO NOTHING", events, job_ids, teams, ats)
