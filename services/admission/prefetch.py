"""A consumed batch's submission lookups in one statement (docs/admission.md, "Batch-end writes").

Each submission asks Postgres whether its job id is taken (and by which team) and whether a cancel for it came first
(a tombstone).
One round trip per submission was the largest single cost of a burst in admission's process: a batch of 256
submissions waited for 256 answers in turn. The runtime's `ServiceSpec.prefetch` hook calls `prefetch_submissions`
once per attempt at a batch, before its first handler, and `on_submitted` takes its answer from the batch's scratch.

An answer read at the batch's start is still true when the submission's handler runs only if nothing handled before
it in the batch touched that job's rows: so only a job's first message of the batch is served (a second submission
of the same id, or one after a cancel request for it, asks Postgres itself, as does every submission after an event
about no single job, such as a configuration change). Rows of a job no earlier message of the batch concerns are
written by this service alone (one instance holds the lease), and only inside its handlers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import asyncpg

from shared.events import CloudEvent, JobSubmitted

SCRATCH_KEY = "admission-submission-lookup"


class Known(NamedTuple):
    """What admission's tables say of a submission's job id: the status and team of the job holding it (None, None:
    no job holds it), and whether a cancel from the submitting team came before it."""

    status: str | None
    holder: str | None
    tombstoned: bool


def served_submissions(messages: Sequence[tuple[CloudEvent, Any, str]]) -> list[tuple[str, str]]:
    """(job id, team) of the batch's submissions a lookup made at its start answers truly, in batch order: each
    job's first message of the batch, up to the first event that names no job. The team is the subject's."""
    mentioned: set[str] = set()
    served: list[tuple[str, str]] = []
    for event, payload, subject in messages:
        if isinstance(payload, JobSubmitted):
            job = payload.spec.job_id
            if job not in mentioned:
                served.append((job, JobSubmitted.scope_of(subject) or ""))
            mentioned.add(job)
            continue
        about = getattr(payload, "job_id", None) or event.subject
        if not isinstance(about, str) or not about:
            break  # about no one job (a configuration change, a usage report): what it changes is not known here
        mentioned.add(about)
    return served


async def prefetch_submissions(conn: asyncpg.Connection, messages: Sequence[tuple[CloudEvent, Any, str]],
                               scratch: dict[str, Any]) -> None:
    """`ServiceSpec.prefetch` for admission: every served submission's `Known` (status and team of a row with its id,
    whether a tombstone for it and its team waits) in one statement, left in `scratch` for `take`."""
    served = served_submissions(messages)
    if served:
        scratch[SCRATCH_KEY] = await _read(conn, served)


async def lookup(conn: asyncpg.Connection, job_id: str, team: str) -> Known:
    """One submission's `Known`: when there is no prefetched answer (`take`)."""
    return (await _read(conn, [(job_id, team)]))[(job_id, team)]


async def _read(conn: asyncpg.Connection, wanted: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Known]:
    rows = await conn.fetch(
        "SELECT u.id, u.team, j.status AS existing, j.team AS holder, "
        "EXISTS (SELECT 1 FROM admission.tombstones t WHERE t.job_id = u.id AND t.team = u.team) AS tombstoned "
        "FROM unnest($1::text[], $2::text[]) AS u(id, team) LEFT JOIN admission.jobs j ON j.job_id = u.id",
        [job for job, _ in wanted], [team for _, team in wanted])
    return {(r["id"], r["team"]): Known(r["existing"], r["holder"], r["tombstoned"]) for r in rows}


def take(scratch: dict[str, Any], job_id: str, team: str) -> Known | None:
    """The prefetched `Known` of this submission, once; None: not prefetched, ask Postgres."""
    lookup = scratch.get(SCRATCH_KEY)
    return None if lookup is None else lookup.pop((job_id, team), None)
