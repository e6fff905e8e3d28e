"""Metering's Postgres store (schema `metering`): idempotent ledger writes and the reads reports need.

Idempotence does not rest on the runtime's inbox alone: facts are keyed by what they say
(job, kind, instant) and samples by what they measure (node, GPU, instant), so the same fact or sample
arriving again under a new event id — a producer retry, a replay — changes nothing either.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeAlias

import asyncpg

from services.core.metering.rollup import UNKNOWN, AllocationRow, JobDims, UsageRow, team_summary_table
from services.core.metering.samples import sample_columns
from services.core.metering.segments import Fact, FactKind, build_segments
from services.core.metering.units import HOUR_MS, from_ms, model_hint, node_shares, to_ms
from services.scheduler import readmodel
from shared.db import apply_migrations
from shared.events import JobPlaced, JobResized, UtilizationSampled

SCHEMA = "metering"
MIGRATIONS = Path(__file__).resolve().parent / "migrations"

Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


async def migrate(pool: asyncpg.Pool) -> list[str]:
    return await apply_migrations(pool, SCHEMA, MIGRATIONS)


# --------------------------------------------------------------------------- lifecycle facts


async def _lock_job(conn: Conn, job_id: str) -> None:
    # Serialise writers of one job (replicas, or a retried delivery racing the first) so a segment rebuild
    # always sees every committed fact of the job.
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"metering:{job_id}")


# The job's lock (the key `_lock_job` takes) in the statement that writes its fact: one round trip per fact. The
# writes read their rows from this CTE, so the lock is held before either touches a row (and until the commit).
_LOCK = "lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended('metering:' || $1::text, 0)))"
_UPSERT_DIMS = """INSERT INTO metering.jobs AS j (job_id, team, queue, priority_class, kind, user_name, labels, spec_at)
           {values}
           ON CONFLICT (job_id) DO UPDATE SET team = EXCLUDED.team, queue = EXCLUDED.queue,
               priority_class = EXCLUDED.priority_class, kind = EXCLUDED.kind, user_name = EXCLUDED.user_name,
               labels = EXCLUDED.labels, spec_at = EXCLUDED.spec_at
           WHERE EXCLUDED.spec_at < j.spec_at"""
_INSERT_FACT = """INSERT INTO metering.job_facts (job_id, kind, at, detail) {values}
           ON CONFLICT DO NOTHING"""


@dataclass(frozen=True)
class FactRow:
    """A fact as written: the job, its kind, when, and its detail as JSON (sorted keys: the same fact encodes the
    same)."""

    job_id: str
    kind: FactKind
    at: datetime
    detail: str


@dataclass(frozen=True)
class DimsRow:
    """A job's dimensions from a placement's spec; the earliest placement's win (`spec_at`)."""

    job_id: str
    team: str
    queue: str
    priority_class: str
    kind: str
    user_name: str | None
    labels: str
    spec_at: datetime


def placed_rows(p: JobPlaced) -> tuple[DimsRow, FactRow]:
    spec = p.spec
    dims = DimsRow(spec.job_id, spec.team, spec.queue, spec.priority_class, spec.kind.value, spec.user,
                   json.dumps(dict(sorted(spec.labels.items()))), p.placed_at)
    detail = {"shares": [list(s) for s in node_shares(p.bindings, spec)], "model_hint": model_hint(spec)}
    return dims, fact_row(spec.job_id, FactKind.PLACED, p.placed_at, detail)


def resize_detail(p: JobResized) -> dict[str, Any]:
    """A resize's fact detail: the pods it runs with now, as a placement's (`placed_rows`)."""
    return {"shares": [list(s) for s in node_shares(p.bindings, p.spec)], "model_hint": model_hint(p.spec)}


def fact_row(job_id: str, kind: FactKind, at: datetime, detail: Mapping[str, Any] | None = None) -> FactRow:
    return FactRow(job_id, kind, at, json.dumps(dict(detail or {}), sort_keys=True))


async def record_placed(conn: Conn, p: JobPlaced, *, rebuild: set[str] | None = None) -> bool:
    """Record a placement and the job's dimensions, in one statement with the job's lock. Returns False when the
    fact was already known. With `rebuild`, the job's allocations are not rebuilt here: its id is added to the set,
    for `rebuild_allocations_many` later in the same transaction (the job's lock is held until its commit)."""
    dims, fact = placed_rows(p)
    inserted = await conn.fetchval(
        f"WITH {_LOCK}, dims AS ("
        f"{_UPSERT_DIMS.format(values='SELECT $1, $2, $3, $4, $5, $6, $7::jsonb, $8 FROM lock')})"
        f" {_INSERT_FACT.format(values='SELECT $1, $9, $8, $10::jsonb FROM lock')} RETURNING true",
        dims.job_id, dims.team, dims.queue, dims.priority_class, dims.kind, dims.user_name, dims.labels,
        dims.spec_at, fact.kind.value, fact.detail)
    return await _after_insert(conn, fact.job_id, bool(inserted), rebuild)


async def record_fact(conn: Conn, job_id: str, kind: FactKind, at: datetime,
                      detail: Mapping[str, Any] | None = None, *, rebuild: set[str] | None = None) -> bool:
    """Record a start, end or preemption fact (`detail` of a preemption carries `lost_ms`), in one statement with
    the job's lock; `rebuild` as for `record_placed`."""
    fact = fact_row(job_id, kind, at, detail)
    inserted = await conn.fetchval(
        f"WITH {_LOCK} {_INSERT_FACT.format(values='SELECT $1, $2, $3, $4::jsonb FROM lock')} RETURNING true",
        fact.job_id, fact.kind.value, fact.at, fact.detail)
    return await _after_insert(conn, job_id, bool(inserted), rebuild)


async def _after_insert(conn: Conn, job_id: str, inserted: bool, rebuild: set[str] | None) -> bool:
    if not inserted:
        return False
    if rebuild is not None:
        rebuild.add(job_id)
    else:
        await rebuild_allocations(conn, job_id)
    return True


async def record_facts_many(conn: Conn, facts: Sequence[FactRow], dims: Sequence[DimsRow]) -> set[str]:
    """Write many jobs' facts and dimensions at once (a batch's, at its end): three statements whatever their
    number. Every job's lock is taken first, in job id order (two writers of overlapping jobs lock them in the same
    order: no deadlock). A fact already known changes nothing; returns the jobs that got a new fact, whose
    allocations the caller rebuilds (`rebuild_allocations_many`) in the same transaction."""
    jobs = sorted({f.job_id for f in facts} | {d.job_id for d in dims})
    if not jobs:
        return set()
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('metering:' || j, 0)) "
                       "FROM (SELECT j FROM unnest($1::text[]) AS t(j) ORDER BY j) AS s", jobs)
    earliest: dict[str, DimsRow] = {}  # one row per job (an upsert may touch a row once): the earliest placement
    for d in dims:
        if d.job_id not in earliest or d.spec_at < earliest[d.job_id].spec_at:
            earliest[d.job_id] = d
    if earliest:
        rows = [earliest[j] for j in sorted(earliest)]
        await conn.execute(
            _UPSERT_DIMS.format(values="SELECT j, t, q, p, k, u, l::jsonb, s FROM unnest($1::text[], $2::text[], "
                                       "$3::text[], $4::text[], $5::text[], $6::text[], $7::text[], "
                                       "$8::timestamptz[]) AS x(j, t, q, p, k, u, l, s)"),
            [d.job_id for d in rows], [d.team for d in rows], [d.queue for d in rows],
            [d.priority_class for d in rows], [d.kind for d in rows], [d.user_name for d in rows],
            [d.labels for d in rows], [d.spec_at for d in rows])
    if not facts:
        return set()
    inserted = await conn.fetch(
        _INSERT_FACT.format(values="SELECT j, k, a, d::jsonb FROM unnest($1::text[], $2::text[], $3::timestamptz[], "
                                   "$4::text[]) AS x(j, k, a, d)")
        + " RETURNING job_id",
        [f.job_id for f in facts], [f.kind.value for f in facts], [f.at for f in facts], [f.detail for f in facts])
    return {r["job_id"] for r in inserted}


def _fact_from_row(row: asyncpg.Record) -> Fact:
    detail = json.loads(row["detail"])
    kind = FactKind(row["kind"])
    return Fact(
        kind=kind,
        at_ms=to_ms(row["at"]),
        shares=tuple((str(n), int(m)) for n, m in detail.get("shares", [])),
        model_hint=detail.get("model_hint"),
        lost_ms=int(detail.get("lost_ms", 0)),
        # a failed attempt that is retried (handlers.on_attempt_failed records its number) does not end the job
        retried=kind is FactKind.FAILED and "attempt" in detail,
    )


async def rebuild_allocations(conn: Conn, job_id: str) -> None:
    """Recompute a job's allocation rows from all its facts (order-independent by construction)."""
    await rebuild_allocations_many(conn, [job_id])


async def rebuild_allocations_many(conn: Conn, job_ids: Iterable[str]) -> None:
    """`rebuild_allocations` for several jobs, in three statements whatever their number. The caller holds each
    job's lock (`_lock_job`, taken before its facts were written), so every committed fact of each is seen."""
    jobs = sorted(set(job_ids))
    if not jobs:
        return
    facts: dict[str, list[Fact]] = {job: [] for job in jobs}
    for r in await conn.fetch("SELECT job_id, kind, at, detail FROM metering.job_facts WHERE job_id = ANY($1)", jobs):
        facts[r["job_id"]].append(_fact_from_row(r))
    await conn.execute("DELETE FROM metering.allocations WHERE job_id = ANY($1)", jobs)
    rows = [(job, p) for job in jobs for p in build_segments(facts[job])]
    if not rows:
        return
    parts = [p for _, p in rows]
    await conn.execute(
        """INSERT INTO metering.allocations
               (job_id, placed_at, node, milli_gpus, model_hint, started_at, ended_at, end_kind, lost_ms)
           SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::text[], $4::int[], $5::text[],
                                $6::timestamptz[], $7::timestamptz[], $8::text[], $9::bigint[])""",
        [job for job, _ in rows],
        [from_ms(p.placed_at_ms) for p in parts], [p.node for p in parts], [p.milli_gpus for p in parts],
        [p.model_hint for p in parts],
        [from_ms(p.started_at_ms) if p.started_at_ms is not None else None for p in parts],
        [from_ms(p.ended_at_ms) if p.ended_at_ms is not None else None for p in parts],
        [p.end_kind for p in parts], [p.lost_ms for p in parts])


# --------------------------------------------------------------------------- samples

_INSERT_SAMPLES = """
WITH s AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::text[], $5::int[], $6::real[],
                         $7::int[], $8::real[], $9::real[], $10::bigint[], $11::bigint[], $14::int[], $15::int[],
                         $16::boolean[])
        AS t(node, gpu_index, sampled_at, job_id, interval_ms, utilization_pct, memory_used_mib, power_w,
             temperature_c, used_gpu_ms, energy_mj, gpu_instance, milli_gpus, approximate)
), ins AS (
    INSERT INTO metering.gpu_samples (node, gpu_index, sampled_at, job_id, interval_ms, utilization_pct,
                                      memory_used_mib, power_w, temperature_c, used_gpu_ms, energy_mj,
                                      gpu_instance, milli_gpus, approximate)
    SELECT * FROM s ON CONFLICT DO NOTHING
    RETURNING job_id, node, sampled_at, interval_ms, used_gpu_ms, energy_mj, milli_gpus
), m AS (
    -- The GPU model a sample names is the sample's own fact (the node's model is the scheduler's): it is kept
    -- with the usage it fed, for nodes the scheduler never announced.
    SELECT node, min(model) AS model FROM unnest($12::text[], $13::text[]) AS t(node, model) GROUP BY node
), agg AS (
    -- A sample covers (sampled_at - interval, sampled_at]: it belongs to the hour its interval starts in.
    -- A MIG instance's sample covers its slice's share of a GPU (milli_gpus), whole GPUs 1000.
    SELECT job_id, node, min(m.model) AS model,
           date_bin('1 hour', sampled_at - interval_ms * interval '1 millisecond',
                    timestamptz '1970-01-01 00:00:00+00') AS hour,
           count(*) AS samples, sum(interval_ms::bigint * milli_gpus / 1000)::bigint AS sampled_gpu_ms,
           sum(used_gpu_ms)::bigint AS used,
           sum(energy_mj)::bigint AS energy, max(sampled_at) AS last_at
    FROM ins LEFT JOIN m USING (node) WHERE job_id IS NOT NULL GROUP BY 1, 2, 4
), up AS (
    -- Rows are upserted in key order so concurrent batches lock them in the same order (no deadlock).
    INSERT INTO metering.usage_hourly AS u
        (job_id, node, hour, samples, sampled_gpu_ms, used_gpu_ms, energy_mj, last_sample_at, gpu_model)
    SELECT job_id, node, hour, samples, sampled_gpu_ms, used, energy, last_at, model FROM agg
    ORDER BY job_id, node, hour
    ON CONFLICT (job_id, node, hour) DO UPDATE SET
        samples = u.samples + EXCLUDED.samples,
        sampled_gpu_ms = u.sampled_gpu_ms + EXCLUDED.sampled_gpu_ms,
        used_gpu_ms = u.used_gpu_ms + EXCLUDED.used_gpu_ms,
        energy_mj = u.energy_mj + EXCLUDED.energy_mj,
        last_sample_at = GREATEST(u.last_sample_at, EXCLUDED.last_sample_at),
        gpu_model = COALESCE(u.gpu_model, EXCLUDED.gpu_model)
)
SELECT count(*) FROM ins
"""


async def record_samples(conn: Conn, events: Sequence[UtilizationSampled]) -> int:
    """Insert every GPU sample of `events` in one statement; returns how many were new.

    Only newly inserted samples increment the hourly rollup (the CTE feeds on INSERT … RETURNING), so a
    redelivered or replayed sample is counted exactly once, whatever the order of arrival."""
    cols = sample_columns(events)
    if not len(cols):
        return 0
    return int(await conn.fetchval(_INSERT_SAMPLES, *cols.arrays()))


# Raw samples deleted per statement: each batch is a short transaction of its own, so pruning a backlog (the first
# pass after an upgrade, or after a longer window was shortened) never holds a long one beside the sample inserts.
PRUNE_SAMPLES_BATCH = 50_000


async def prune_samples(conn: Conn, older_than: datetime, *, batch: int = PRUNE_SAMPLES_BATCH) -> int:
    """Delete raw samples taken before `older_than`, `batch` rows per statement; returns how many. The reports read
    only the hourly rollups (metering.usage_hourly, filled as each sample arrived), which stay. Keep at least the
    utilisation stream's max age (shared.retention.METERING_RAW): a sample redelivered after its raw row is gone
    would be counted twice. Outside a transaction each statement commits on its own."""
    total = 0
    while True:
        status = await conn.execute(
            "DELETE FROM metering.gpu_samples WHERE ctid = ANY(ARRAY(SELECT ctid FROM metering.gpu_samples "
            "WHERE sampled_at < $1 LIMIT $2))", older_than, batch)
        deleted = int(status.split()[-1])
        total += deleted
        if deleted < batch:
            return total


# --------------------------------------------------------------------------- rates


async def set_rates(conn: Conn, rates: Mapping[str, float], at: datetime) -> bool:
    """Replace the price list (queues.yaml gpu_flavors) unless a newer one was already set."""
    latest = await conn.fetchval("SELECT max(set_at) FROM metering.rates")
    if latest is not None and latest > at:
        return False
    await conn.execute("DELETE FROM metering.rates")
    models = sorted(rates)
    await conn.execute(
        "INSERT INTO metering.rates (gpu_model, cost_per_gpu_hour, set_at) "
        "SELECT m, r, $3 FROM unnest($1::text[], $2::float8[]) AS t(m, r)",
        models, [float(rates[m]) for m in models], at)
    return True


async def set_usage_half_life(conn: Conn, half_life_s: float | None, at: datetime) -> bool:
    """Record the half-life of fair share over time (None: off) unless a newer configuration already set it."""
    updated = await conn.fetchval(
        """INSERT INTO metering.usage_policy AS p (id, half_life_s, set_at) VALUES (1, $1, $2)
           ON CONFLICT (id) DO UPDATE SET half_life_s = EXCLUDED.half_life_s, set_at = EXCLUDED.set_at
           WHERE p.set_at <= EXCLUDED.set_at RETURNING true""", half_life_s, at)
    return bool(updated)


async def usage_half_life(conn: Conn) -> float | None:
    value = await conn.fetchval("SELECT half_life_s FROM metering.usage_policy WHERE id = 1")
    return float(value) if value is not None else None


# Allocations that ended more than this many half-lives before the report weigh less than 2^-30 of their GPU time.
USAGE_HORIZON_HALF_LIVES = 30


async def node_models(conn: Conn) -> tuple[list[str], list[str]]:
    """Node names and their GPU models, as the scheduler records them (its read model, removed nodes included so
    that past allocations keep their model), as two parallel arrays for `unnest`."""
    facts = sorted((f.name, f.spec.gpu_model) for f in await readmodel.node_facts(conn, include_removed=True))
    return [f[0] for f in facts], [f[1] for f in facts]


async def decayed_usage(conn: Conn, now: datetime, half_life_s: float) -> dict[str, dict[str, float]]:
    """The read model of fair share over time: per queue and GPU model, the GPU-seconds allocated to its jobs
    before `now`, each weighted 2^(−a/H) for a GPU-second `a` seconds before `now`. An allocation [s, e) weighs
    τ·(e^(−(now−e)/τ) − e^(−(now−s)/τ)) GPU-seconds per GPU with τ = H / ln 2 (exact, no sampling). The GPU model
    is the node's (or the job's only model); allocations of unknown model and lost-work rows are left out."""
    if half_life_s <= 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
    tau = half_life_s / math.log(2)
    horizon = now - timedelta(seconds=half_life_s * USAGE_HORIZON_HALF_LIVES)
    names, models = await node_models(conn)
    rows = await conn.fetch(
        """SELECT j.queue, coalesce(n.gpu_model, s.gpu_model, a.model_hint) AS model,
                  sum(a.milli_gpus / 1000.0 * $3 * (
                      exp(-least(700.0, extract(epoch FROM $1 - least(coalesce(a.ended_at, $1), $1))::float8 / $3))
                    - exp(-least(700.0, extract(epoch FROM $1 - a.placed_at)::float8 / $3)))) AS gpu_s
           FROM metering.allocations a JOIN metering.jobs j USING (job_id)
                LEFT JOIN unnest($4::text[], $5::text[]) AS n(node, gpu_model) ON n.node = a.node
                LEFT JOIN LATERAL (SELECT u.gpu_model FROM metering.usage_hourly u
                                   WHERE u.job_id = a.job_id AND u.node = a.node AND u.gpu_model IS NOT NULL
                                   ORDER BY u.hour LIMIT 1) s ON true
           WHERE a.node <> '' AND a.placed_at < $1 AND (a.ended_at IS NULL OR a.ended_at > $2)
             AND coalesce(n.gpu_model, s.gpu_model, a.model_hint) IS NOT NULL
           GROUP BY 1, 2 ORDER BY 1, 2""", now, horizon, tau, names, models)
    usage: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["gpu_s"] > 0:
            usage.setdefault(r["queue"], {})[r["model"]] = float(r["gpu_s"])
    return usage


async def load_rates(conn: Conn) -> dict[str, float]:
    rows = await conn.fetch("SELECT gpu_model, cost_per_gpu_hour FROM metering.rates ORDER BY gpu_model")
    return {r["gpu_model"]: float(r["cost_per_gpu_hour"]) for r in rows}


# --------------------------------------------------------------------------- reads


@dataclass(frozen=True)
class LedgerSlice:
    allocations: list[AllocationRow]
    usage: list[UsageRow]
    dims: dict[str, JobDims]
    horizon_ms: int | None  # latest instant the ledger has heard of (None = empty ledger)


async def ledger_horizon(conn: Conn) -> int | None:
    row = await conn.fetchrow(
        """SELECT (SELECT max(at) FROM metering.job_facts) AS facts,
                  (SELECT max(last_sample_at) FROM metering.usage_hourly
                    WHERE hour = (SELECT max(hour) FROM metering.usage_hourly)) AS samples""")
    known = [to_ms(t) for t in (row["facts"], row["samples"]) if t is not None]
    return max(known) if known else None


async def load_ledger(conn: Conn, since: datetime | None = None, until: datetime | None = None) -> LedgerSlice:
    """Allocations overlapping [since, until), hourly usage inside it, and the dimensions of their jobs."""
    lo = since or datetime.fromisoformat("1970-01-01T00:00:00+00:00")
    hi = until or datetime.fromisoformat("9999-01-01T00:00:00+00:00")
    # A node's GPU model is the scheduler's fact; then the model the job's own samples named; then the one its
    # spec allows.
    names, models = await node_models(conn)
    arows = await conn.fetch(
        """SELECT a.job_id, COALESCE(n.gpu_model, s.gpu_model, a.model_hint, $3) AS gpu_model, a.milli_gpus,
                  a.placed_at, a.ended_at, a.lost_ms
           FROM metering.allocations a
           LEFT JOIN unnest($4::text[], $5::text[]) AS n(node, gpu_model) ON n.node = a.node
           LEFT JOIN LATERAL (SELECT u.gpu_model FROM metering.usage_hourly u
                              WHERE u.job_id = a.job_id AND u.node = a.node AND u.gpu_model IS NOT NULL
                              ORDER BY u.hour LIMIT 1) s ON true
           WHERE a.placed_at < $2 AND (a.ended_at IS NULL OR a.ended_at >= $1)
           ORDER BY a.job_id, a.placed_at, a.node""", lo, hi, UNKNOWN, names, models)
    urows = await conn.fetch(
        """SELECT u.job_id, COALESCE(n.gpu_model, u.gpu_model, h.model_hint, $3) AS gpu_model, u.hour,
                  sum(u.used_gpu_ms)::bigint AS used, sum(u.sampled_gpu_ms)::bigint AS sampled,
                  sum(u.energy_mj)::bigint AS energy, sum(u.samples)::bigint AS samples
           FROM metering.usage_hourly u
           LEFT JOIN unnest($4::text[], $5::text[]) AS n(node, gpu_model) ON n.node = u.node
           LEFT JOIN LATERAL (SELECT a.model_hint FROM metering.allocations a
                              WHERE a.job_id = u.job_id AND a.model_hint IS NOT NULL LIMIT 1) h ON true
           WHERE u.hour >= date_bin('1 hour', $1, timestamptz '1970-01-01 00:00:00+00') AND u.hour < $2
           GROUP BY 1, 2, 3 ORDER BY 1, 2, 3""", lo, hi, UNKNOWN, names, models)
    allocations = [AllocationRow(r["job_id"], r["gpu_model"], r["milli_gpus"], to_ms(r["placed_at"]),
                                 to_ms(r["ended_at"]) if r["ended_at"] is not None else None, r["lost_ms"])
                   for r in arows]
    usage = [UsageRow(r["job_id"], r["gpu_model"], to_ms(r["hour"]), r["used"], r["sampled"], r["energy"],
                      r["samples"]) for r in urows]
    job_ids = sorted({a.job_id for a in allocations} | {u.job_id for u in usage})
    drows = await conn.fetch(
        "SELECT job_id, team, queue, priority_class, kind, user_name, labels FROM metering.jobs "
        "WHERE job_id = ANY($1::text[])", job_ids)
    dims = {r["job_id"]: JobDims(r["job_id"], r["team"], r["queue"], r["priority_class"], r["kind"],
                                 r["user_name"] or "(none)", tuple(sorted(json.loads(r["labels"]).items())))
            for r in drows}
    return LedgerSlice(allocations, usage, dims, await ledger_horizon(conn))


async def team_summary(conn_or_pool: Conn | asyncpg.Pool, *, rates: Mapping[str, float] | None = None,
                       horizon_ms: int | None = None) -> list[dict[str, Any]]:
    """Per team: jobs, allocated / used / idle / lost GPU-hours and cost over the whole ledger.

    Rates default to the stored price list; allocations still open count until the ledger's horizon
    (the latest fact or sample it holds), so accelerated or replayed time gives the same table."""
    if isinstance(conn_or_pool, asyncpg.Pool):
        async with conn_or_pool.acquire() as conn:
            return await team_summary(conn, rates=rates, horizon_ms=horizon_ms)
    conn = conn_or_pool
    ledger = await load_ledger(conn)
    if rates is None:
        rates = await load_rates(conn)
    horizon = horizon_ms if horizon_ms is not None else (ledger.horizon_ms or 0)
    return team_summary_table(ledger.allocations, ledger.usage, ledger.dims, horizon_ms=horizon, rates=rates)


__all__ = [
    "HOUR_MS", "MIGRATIONS", "SCHEMA", "LedgerSlice", "load_ledger", "load_rates", "migrate", "prune_samples",
    "rebuild_allocations", "rebuild_allocations_many", "record_fact", "record_facts_many", "record_placed",
    "record_samples", "set_rates",
    "team_summary",
]
