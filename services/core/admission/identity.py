"""Whose a job id is (docs/security.md, "Job identity").

Job ids are one namespace for every team: each service keys its rows and events by the id alone. So a submission
whose id another team holds is refused, and the refusal must tell the submitter nothing about that team's job (not
its team, not its state): it reads the same whether the id is taken by another team or reserved for one.

An id of the form `<team>::<name>` is qualified: it is reserved for that team, so no other team can take it before
its owner does (ids are first come, first served otherwise). Team names cannot contain ':', so the owner is the part
before the first `::`. Ids the API assigns (a submission without one) are qualified and random.

Pure: no I/O, no randomness (the caller hands the random part of an assigned id).
"""

from __future__ import annotations

QUALIFIER = "::"
# The refusal of an id that is not the submitting team's to use (JobRejected.reason, the API's 409).
JOB_ID_UNAVAILABLE = "JobIdUnavailable"
DUPLICATE_JOB_ID = "DuplicateJobId"  # the submitting team's own job already has this id


def owner_of(job_id: str) -> str | None:
    """The team a qualified id (`<team>::<name>`) is reserved for; None for an unqualified id."""
    team, sep, _ = job_id.partition(QUALIFIER)
    return team if sep and team else None


def assigned_id(team: str, token: str) -> str:
    """A server-assigned id: qualified with the team, so nobody else can take it, and unguessable through `token`
    (the caller's random hex)."""
    return f"{team}{QUALIFIER}{token}"


def unavailable(job_id: str, team: str, holder: str | None) -> tuple[str, str] | None:
    """Why `team` may not submit `job_id`, which `holder` already holds (None: no job has it), or None when it may.

    The same reason and message whether another team holds the id or it is reserved for another team, and the same
    for every other team's job: nothing in it says whose the job is or what state it is in."""
    owner = owner_of(job_id)
    if (owner is not None and owner != team) or (holder is not None and holder != team):
        return JOB_ID_UNAVAILABLE, unavailable_message(job_id, team)
    return None


def unavailable_message(job_id: str, team: str) -> str:
    return (f"job id {job_id} is not available to team {team}: another team holds it or it is reserved for one; "
            f"choose another (ids '{team}{QUALIFIER}<name>' are reserved for team {team}, and a submission through "
            f"the API without a job_id is given one)")
