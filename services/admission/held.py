"""Rows held for the end of a batch (docs/admission.md, "Batch-end writes"): a batch of submissions writes its
`admission.jobs` and `admission.submissions` rows in two statements instead of two per job, and a batch's
placements, starts and ends of jobs write their `admission.jobs` updates in one statement per kind instead of one
per message.

A handler holds them in the unit of work's scratch (`Tx.scratch`) only where any failure rolls the whole transaction
back (`Tx.own_savepoint` false): a crash or a failure before the commit loses the held rows with everything else of
the batch (its inbox rows included, so the redelivered messages are handled again, once). Whatever reads or writes
those tables next in the same transaction (another handler, the admission cycle) writes them first, so it sees every
job the batch queued and every change it made before it; a handler that holds rows also asks for `write_held` after
the batch's events (`Tx.after_events`), so a unit without a cycle writes them too."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.service import Tx

SCRATCH_KEY = "admission-held-submissions"
AFTER_EVENTS_KEY = "admission-held"  # the deferred work that writes what is left (sorted after "admission-cycle")


@dataclass
class HeldSubmissions:
    # job id -> (team, queue, spec JSON, received at, predicted GPU-seconds), in the order the jobs arrived
    jobs: dict[str, tuple[str, str, str, float, float | None]] = field(default_factory=dict)
    # (event id, job id, team, at) of each queued verdict
    verdicts: list[tuple[str, str, str, float]] = field(default_factory=list)
    # Updates of admitted jobs' rows (the handler checked in memory that the job is admitted, which the row's
    # status agrees with): job id -> bindings JSON (JobPlaced); job id -> (started at, expected end) (JobStarted).
    placed: dict[str, str] = field(default_factory=dict)
    started: dict[str, tuple[float, float]] = field(default_factory=dict)
    # job id -> (finished at, outcome) of jobs that completed or failed (JobCompleted, JobFailed)
    finished: dict[str, tuple[float, str]] = field(default_factory=dict)

    def updates(self, job_id: str) -> bool:
        """Does an update of this job's row wait here?"""
        return job_id in self.placed or job_id in self.started or job_id in self.finished


def held_rows(tx: Tx) -> HeldSubmissions | None:
    found = tx.scratch.get(SCRATCH_KEY)
    return found if isinstance(found, HeldSubmissions) else None


def hold_rows(tx: Tx) -> HeldSubmissions:
    rows: HeldSubmissions = tx.scratch.setdefault(SCRATCH_KEY, HeldSubmissions())
    return rows


async def write_held(tx: Tx) -> None:
    """Write the held rows (if any) and forget them: the new jobs in arrival order, then the updates of jobs admitted
    before this batch (placements and starts before ends: a job placed, started and finished in one batch ends
    finished, as when each message wrote its own row; its placement and start are kept, as then)."""
    rows = tx.scratch.pop(SCRATCH_KEY, None)
    if not isinstance(rows, HeldSubmissions):
        return
    if rows.jobs:
        jobs = list(rows.jobs)
        columns = [list(c) for c in zip(*rows.jobs.values(), strict=True)]
        await tx.conn.execute(
            "INSERT INTO admission.jobs(job_id, team, queue, spec, status, submitted_at, predicted_gpu_s) "
            "SELECT j, t, q, s::jsonb, 'pending', a, p FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], "
            "$5::float8[], $6::float8[]) WITH ORDINALITY AS u(j, t, q, s, a, p, n) ORDER BY n",
            jobs, *columns)
    if rows.verdicts:
        events, job_ids, teams, ats = (list(c) for c in zip(*rows.verdicts, strict=True))
        await tx.conn.execute(
            "INSERT INTO admission.submissions(event_id, job_id, team, verdict, at) "
            "SELECT e, j, t, 'queued', a FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) "
            "AS u(e, j, t, a) ON CONFLICT (event_id) DO NOTHING", events, job_ids, teams, ats)
    if rows.placed:
        await tx.conn.execute(
            "UPDATE admission.jobs AS j SET bindings = u.b::jsonb FROM unnest($1::text[], $2::text[]) AS u(id, b) "
            "WHERE j.job_id = u.id AND j.status = 'admitted'", list(rows.placed), list(rows.placed.values()))
    if rows.started:
        at, end = (list(c) for c in zip(*rows.started.values(), strict=True))
        await tx.conn.execute(
            "UPDATE admission.jobs AS j SET started_at = u.s, expected_end = u.e "
            "FROM unnest($1::text[], $2::float8[], $3::float8[]) AS u(id, s, e) "
            "WHERE j.job_id = u.id AND j.status = 'admitted'", list(rows.started), at, end)
    if rows.finished:
        at, outcome = (list(c) for c in zip(*rows.finished.values(), strict=True))
        await tx.conn.execute(
            "UPDATE admission.jobs AS j SET status = 'finished', finished_at = u.f, outcome = u.o, reason = NULL, "
            "message = NULL, retry_not_before = NULL FROM unnest($1::text[], $2::float8[], $3::text[]) AS u(id, f, o) "
            "WHERE j.job_id = u.id AND j.status IN ('pending', 'admitted')", list(rows.finished), at, outcome)
