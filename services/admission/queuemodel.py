"""Admission's read model of its queues, version 1 (the view `admission.v1_queues`,
migrations/011_queue_summaries.sql): one row per configured queue, what `gpuq queues` and GET /v1/queues show.

Admission writes the rows that changed after each unit of work's admission cycle, in that unit's transaction
(`write`), from the core's `queue_facts`: readers see the committed state when they read, and never rebuild
admission's memory from its jobs to answer. The rows carry the oldest pending job's submit time; a reader turns it
into a wait at its own clock (`QueueFacts.at`). This module imports nothing of admission's shell: any service may
use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from services.admission.readmodel import Conn
from services.core.admission.model import QueueFacts

QUEUES_VIEW = "admission.v1_queues"
_COLUMNS = ("queue, cohort, weight, strategy, nominal, used, borrowed, lent, pending, inadmissible, running, "
            "max_running_jobs, oldest_submitted_at")


async def published(conn: Conn) -> bool:
    """Has admission published this read model on this database (its migrations ran)?"""
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", QUEUES_VIEW))


async def queues(conn: Conn) -> list[QueueFacts] | None:
    """Every configured queue's row, sorted by name (as the core sorts them); None before admission has written
    any (its migrations have not run, or it has not started on this database yet)."""
    if not await published(conn):
        return None
    rows = await conn.fetch(f'SELECT {_COLUMNS} FROM {QUEUES_VIEW} ORDER BY queue COLLATE "C"')
    if not rows:
        return None
    return [QueueFacts(queue=r["queue"], cohort=r["cohort"], weight=r["weight"], strategy=r["strategy"],
                       nominal=json.loads(r["nominal"]), used=json.loads(r["used"]),
                       borrowed=json.loads(r["borrowed"]), lent=json.loads(r["lent"]), pending=r["pending"],
                       inadmissible=r["inadmissible"], running=r["running"], max_running_jobs=r["max_running_jobs"],
                       oldest_submitted_at=r["oldest_submitted_at"])
            for r in rows]


async def write(conn: Conn, facts: Iterable[QueueFacts], written: Mapping[str, QueueFacts],
                configured: Iterable[str] | None = None) -> dict[str, QueueFacts]:
    """Admission's side: upsert the rows of `facts` that differ from `written` (what this instance wrote last).
    Given the names of every `configured` queue (after a configuration change), `facts` are all this instance's
    rows and the rows of queues no longer configured are deleted; otherwise `facts` may be some rows only (the
    queues a unit of work touched). Returns what is now written, by queue."""
    given = {f.queue: f for f in facts}
    changed = [f for q, f in given.items() if written.get(q) != f]
    now_written = given if configured is not None else {**written, **given}
    if configured is not None:
        await conn.execute("DELETE FROM admission.queue_summaries WHERE NOT queue = ANY($1::text[])",
                           sorted(configured))
    if changed:
        # one statement for all the changed rows (a cycle that admits in many queues changes many)
        await conn.execute(
            f"INSERT INTO admission.queue_summaries ({_COLUMNS}) "
            "SELECT * FROM unnest($1::text[], $2::text[], $3::float8[], $4::text[], $5::json[], $6::json[], "
            "$7::json[], $8::json[], $9::int4[], $10::int4[], $11::int4[], $12::int4[], $13::float8[]) "
            "ON CONFLICT (queue) DO UPDATE SET cohort = EXCLUDED.cohort, weight = EXCLUDED.weight, "
            "strategy = EXCLUDED.strategy, nominal = EXCLUDED.nominal, used = EXCLUDED.used, "
            "borrowed = EXCLUDED.borrowed, lent = EXCLUDED.lent, pending = EXCLUDED.pending, "
            "inadmissible = EXCLUDED.inadmissible, running = EXCLUDED.running, "
            "max_running_jobs = EXCLUDED.max_running_jobs, oldest_submitted_at = EXCLUDED.oldest_submitted_at",
            [f.queue for f in changed], [f.cohort for f in changed], [f.weight for f in changed],
            [f.strategy for f in changed], [json.dumps(f.nominal) for f in changed],
            [json.dumps(f.used) for f in changed], [json.dumps(f.borrowed) for f in changed],
            [json.dumps(f.lent) for f in changed], [f.pending for f in changed], [f.inadmissible for f in changed],
            [f.running for f in changed], [f.max_running_jobs for f in changed],
            [f.oldest_submitted_at for f in changed])
    return now_written
