"""The runs the platform finished, read from admission's job read model (`admission.v1_jobs`, with the run columns
migrations/012 appended): what `gpuq export-trace` writes as a simulator trace (sim/export.py).

A run is a job submitted in the window that started and finished with an outcome that ran as long as the job
needed or was let (`RAN_ITS_COURSE`); its duration is its last run's (finished - started): a job preempted before
also ran earlier, which is not counted (the work its checkpoint kept is in its last run). Imports nothing of
admission's shell.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.admission.readmodel import Conn, published
from shared.domain import JobSpec

JOBS_VIEW = "admission.v1_jobs"
# Ends after which the run's length is the job's own: it finished, failed by itself, hit its limit, or was
# cancelled by its user while running (a what-if replays it for as long). Lost, NodeFailure, Evicted and the rest
# are the platform's doing: their runs are not the job's.
RAN_ITS_COURSE = ("Succeeded", "Error", "OOMKilled", "DeadlineExceeded", "Cancelled")


@dataclass(frozen=True)
class FinishedRun:
    """One job of the platform's history: its spec as submitted, when, and how long its run took (seconds)."""

    spec: JobSpec
    submitted_at: float  # epoch seconds
    ran_s: float
    outcome: str


async def finished_runs(conn: Conn, since: float, until: float) -> tuple[list[FinishedRun], dict[str, int]]:
    """The runs of the jobs submitted in [since, until) (epoch seconds), by submission time then id, and how many
    jobs of the window were left out, by why (`waiting or running`, `never ran`, `rejected`, or their outcome)."""
    if since >= until:
        raise ValueError(f"need since < until, got {since} >= {until}")
    if not await published(conn):
        return [], {}
    rows = await conn.fetch(
        f"SELECT job_id, spec, status, submitted_at, started_at, finished_at, outcome FROM {JOBS_VIEW} "
        "WHERE submitted_at >= $1 AND submitted_at < $2 ORDER BY submitted_at, job_id", since, until)
    runs: list[FinishedRun] = []
    left_out: dict[str, int] = {}
    for r in rows:
        why = None
        if r["status"] == "rejected":
            why = "rejected"
        elif r["status"] != "finished":
            why = "waiting or running"
        elif r["started_at"] is None:
            why = "never ran"
        elif r["outcome"] not in RAN_ITS_COURSE:
            why = str(r["outcome"])
        if why is not None:
            left_out[why] = left_out.get(why, 0) + 1
            continue
        runs.append(FinishedRun(spec=JobSpec.model_validate_json(r["spec"]), submitted_at=float(r["submitted_at"]),
                                ran_s=max(0.0, float(r["finished_at"]) - float(r["started_at"])),
                                outcome=str(r["outcome"])))
    return runs, dict(sorted(left_out.items()))
