"""The scheduler's cluster read model, version 1: the one place other services read node facts and allocations.

The scheduler owns what the cluster is (nodes as the executors announce them, their health and why it changed) and
who holds which GPUs (placements, the executor-reported start of each run, expected ends). It publishes them as
the views `scheduler.v1_nodes` and `scheduler.v1_placements` (migrations/003_read_model.sql; `started_at` appended
by 004); this module is their typed, read-only accessor, so that no other service mirrors those facts into a table
of its own or folds node events to rebuild them.

Readers get the owner's committed state at the moment they read, on their own connection (any isolation level,
any transaction of theirs). Before the scheduler has ever started on this database the views do not exist: the
cluster is then empty (no node announced yet), as it would be for a scheduler that has heard no inventory.

This module imports nothing of the scheduler's shell (it is not the scheduler's app): any service may use it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

import asyncpg

from shared.domain import GpuBinding, JobSpec, NodeSpec

NODES_VIEW = "scheduler.v1_nodes"
PLACEMENTS_VIEW = "scheduler.v1_placements"

Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


@dataclass(frozen=True)
class NodeFact:
    """One node as the scheduler knows it: its spec, whether it was removed, and why its health last changed."""

    spec: NodeSpec
    removed: bool
    reason: str | None
    message: str

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class PlacementFact:
    """A job holding GPUs now: where (bindings), since when, and until when the scheduler expects it to hold them
    (placement + max_runtime_s, then start + max_runtime_s once the executor reported the start). `started_at` is
    that executor-reported start of this run (None until JobStarted reached the scheduler)."""

    job_id: str
    spec: JobSpec
    flavors: dict[str, str]
    bindings: tuple[GpuBinding, ...]
    placed_at: float
    expected_end: float
    fencing_token: int | None
    started_at: float | None = None


# Whether the views exist, and whether v1_placements has `started_at` yet (appended to v1 by migration 004: during a
# rolling upgrade a new reader may meet a scheduler that has not migrated, and then reads NULL starts).
_PUBLISHED = ("SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL AS published, "
              "EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($2) AND attname = 'started_at' "
              "AND NOT attisdropped) AS has_started_at")


async def published(conn: Conn) -> bool:
    """Has the owner published the read model on this database (its migrations ran)?"""
    return bool((await conn.fetchrow(_PUBLISHED, NODES_VIEW, PLACEMENTS_VIEW))["published"])


@dataclass(frozen=True)
class ClusterRows:
    """The read model's rows as fetched, not parsed yet: fetching is quick, parsing a large cluster is not, so a
    reader may parse them off its event loop (`node_facts_of`, `placements_of` are pure)."""

    nodes: tuple[asyncpg.Record, ...]
    placements: tuple[asyncpg.Record, ...]


async def node_rows(conn: Conn, *, include_removed: bool = False) -> tuple[asyncpg.Record, ...]:
    if not await published(conn):
        return ()
    return tuple(await conn.fetch(f"SELECT spec, removed, reason, message FROM {NODES_VIEW} "
                                  f"{'' if include_removed else 'WHERE NOT removed '}ORDER BY name"))


async def placement_rows(conn: Conn, job_ids: Iterable[str] | None = None) -> tuple[asyncpg.Record, ...]:
    """The placements in force, in placement order; only those of `job_ids` when given."""
    state = await conn.fetchrow(_PUBLISHED, NODES_VIEW, PLACEMENTS_VIEW)
    if not state["published"]:
        return ()
    started = "started_at" if state["has_started_at"] else "NULL::double precision AS started_at"
    select = (f"SELECT job_id, spec, flavors, bindings, placed_at, expected_end, fencing_token, {started} "
              f"FROM {PLACEMENTS_VIEW}")
    if job_ids is None:
        return tuple(await conn.fetch(f"{select} ORDER BY placed_at, job_id"))
    return tuple(await conn.fetch(f"{select} WHERE job_id = ANY($1::text[]) ORDER BY placed_at, job_id",
                                  sorted(set(job_ids))))


async def cluster_rows(conn: Conn) -> ClusterRows:
    """The nodes in the cluster now and the jobs holding GPUs, as one snapshot (a repeatable-read transaction of
    its own, or the caller's transaction)."""
    if conn.is_in_transaction():
        return ClusterRows(nodes=await node_rows(conn), placements=await placement_rows(conn))
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        return ClusterRows(nodes=await node_rows(conn), placements=await placement_rows(conn))


def node_facts_of(rows: Iterable[asyncpg.Record]) -> list[NodeFact]:
    return [NodeFact(spec=NodeSpec.model_validate_json(r["spec"]), removed=bool(r["removed"]), reason=r["reason"],
                     message=r["message"] or "") for r in rows]


def placements_of(rows: Iterable[asyncpg.Record]) -> list[PlacementFact]:
    return [PlacementFact(job_id=r["job_id"], spec=JobSpec.model_validate_json(r["spec"]),
                          flavors=json.loads(r["flavors"]),
                          bindings=tuple(GpuBinding.model_validate(b) for b in json.loads(r["bindings"] or "[]")),
                          placed_at=float(r["placed_at"]), expected_end=float(r["expected_end"]),
                          fencing_token=r["fencing_token"],
                          started_at=float(r["started_at"]) if r["started_at"] is not None else None) for r in rows]


async def node_facts(conn: Conn, *, include_removed: bool = False) -> list[NodeFact]:
    """Every node, by name; removed nodes only when asked (their rows stay so that history keeps their model)."""
    return node_facts_of(await node_rows(conn, include_removed=include_removed))


async def nodes(conn: Conn) -> list[NodeSpec]:
    """The nodes in the cluster now (not removed), by name."""
    return [f.spec for f in await node_facts(conn)]


def held_outside(nodes: Iterable[NodeSpec]) -> dict[str, object]:
    """What pods gpuq does not manage hold on its nodes (another scheduler's, a DaemonSet's, an inference
    Deployment's): GPUs gpuq does not place onto, which no queue's quota can use. `gpuq queues` prints its `line`
    (None when they hold none) and GET /v1/queues/held answers it whole."""
    holding = sorted((n for n in nodes if n.held.gpus or n.held.mig_slices), key=lambda n: n.name)
    gpus = sum(n.held.gpus for n in holding)
    slices = sum(n.held.mig_slices for n in holding)
    line = None
    if holding:
        what = f"{gpus} GPU(s)" + (f" and {slices} MIG slice(s)" if slices else "")
        per_node = ", ".join(f"{n.name} {n.held.gpus}×{n.gpu_model}"
                             + (f" +{n.held.mig_slices} slices" if n.held.mig_slices else "") for n in holding)
        line = f"held outside gpuq: {what} on {len(holding)} node(s) ({per_node})"
    return {"gpus": gpus, "mig_slices": slices, "line": line,
            "nodes": [{"node": n.name, "gpu_model": n.gpu_model, "gpus": n.held.gpus, "mig_slices": n.held.mig_slices,
                       "pods": n.held.pods} for n in holding]}


async def placements(conn: Conn, job_ids: Iterable[str] | None = None) -> list[PlacementFact]:
    """Every job holding GPUs now (or those of `job_ids` that do), in placement order (placed_at, job_id)."""
    return placements_of(await placement_rows(conn, job_ids))
