"""Admission's read model, version 1: what other services read of a job's admission (the view `admission.v1_jobs`,
migrations/009_read_model.sql), instead of mirroring JobSubmitted / JobAdmitted / JobRequeued into a table.

Admission owns a job's admission: its spec as submitted, whether it waits (`pending`), holds quota (`admitted`:
waiting for placement or running), or is done (`finished`, `rejected`), and the flavors it was admitted under. The
preemption service reads a preemptor here when it decides a request (services/preemption/app.py).

Readers see the owner's committed state when they read. Before admission has ever started on this database the
view does not exist, and no job is known. This module imports nothing of admission's shell: any service may use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

from shared.domain import JobSpec

JOBS_VIEW = "admission.v1_jobs"
WAITING = ("pending", "admitted")  # not finished: waiting for quota, or admitted (waiting for a placement, running)

Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


@dataclass(frozen=True)
class AdmissionFact:
    """A job as admission knows it."""

    job_id: str
    queue: str
    spec: JobSpec
    status: str  # pending | admitted | finished | rejected
    flavors: dict[str, str]  # pod set -> GPU model while admitted, else empty

    @property
    def allowed_models(self) -> tuple[str, ...]:
        """The GPU models admission charged the job's quota on (empty unless admitted)."""
        return tuple(sorted(set(self.flavors.values())))


async def published(conn: Conn) -> bool:
    """Has admission published its read model on this database (its migrations ran)?"""
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", JOBS_VIEW))


async def jobs(conn: Conn, job_ids: Iterable[str]) -> dict[str, AdmissionFact]:
    """The jobs of `job_ids` that admission knows, by id."""
    ids = sorted(set(job_ids))
    if not ids or not await published(conn):
        return {}
    rows = await conn.fetch(f"SELECT job_id, queue, spec, status, flavors FROM {JOBS_VIEW} "
                            "WHERE job_id = ANY($1::text[])", ids)
    return {r["job_id"]: AdmissionFact(job_id=r["job_id"], queue=r["queue"],
                                       spec=JobSpec.model_validate_json(r["spec"]), status=r["status"],
                                       flavors=json.loads(r["flavors"]) if r["flavors"] else {})
            for r in rows}


async def job(conn: Conn, job_id: str) -> AdmissionFact | None:
    return (await jobs(conn, (job_id,))).get(job_id)
