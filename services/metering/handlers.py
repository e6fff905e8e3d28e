"""Event handlers: each turns one event into ledger writes (the runtime wraps it in a transaction with the
inbox row). Handlers are idempotent on their own as well (see store.py), so replays and producer retries
under new event ids are harmless too."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import asyncpg

from services.core.metering.segments import FactKind
from services.metering import store
from shared.config import ConfigError, parse_queues
from shared.events import (
    CloudEvent,
    JobAttemptFailed,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobResized,
    JobStarted,
    Payload,
    QueueConfigChanged,
    UtilizationSampled,
)

log = logging.getLogger("gpuq.metering")


class TxLike(Protocol):
    """What a handler needs of shared.service.Tx (tests pass a small stand-in)."""

    conn: asyncpg.Connection
    now: float


_REBUILD = "metering-allocations"  # Tx.scratch and after_events key: the jobs whose allocations are to be rebuilt
_HELD = "metering-held-facts"  # Tx.scratch key: facts held for the batch's end (_Held)


@dataclass
class _Held:
    """Facts and job dimensions a batch's messages hold for its end, written there in three statements."""

    facts: list[store.FactRow] = field(default_factory=list)
    dims: list[store.DimsRow] = field(default_factory=list)


def _held(tx: TxLike) -> _Held | None:
    """Where to hold this message's writes for the batch's end, or None to write them at once. Held only where any
    failure rolls the whole transaction back (a batch handled without savepoints: `Tx.own_savepoint` false) and
    there is a batch end to write them at (`Tx.deferred`): a message in a savepoint of its own could be rolled back
    while its held rows were written at the end anyway (a charge for an event that will come again). Nothing reads
    the facts before the batch's end but the rebuild that runs there, after writing them."""
    scratch: dict[str, Any] | None = getattr(tx, "scratch", None)
    if scratch is None or getattr(tx, "deferred", None) is None or getattr(tx, "own_savepoint", True):
        return None
    held: _Held = scratch.setdefault(_HELD, _Held())
    return held


async def _record(tx: TxLike, job_id: str, kind: FactKind, at: datetime,
                  detail: Mapping[str, Any] | None = None) -> None:
    held = _held(tx)
    if held is not None:
        held.facts.append(store.fact_row(job_id, kind, at, detail))  # added last: nothing after it can fail
    else:
        await store.record_fact(tx.conn, job_id, kind, at, detail, rebuild=_rebuild_set(tx))
    await _rebuild_after_events(tx)


def _rebuild_set(tx: TxLike) -> set[str] | None:
    """The set a runtime unit of work (shared.service.Tx) gathers the jobs to rebuild in, rebuilt once after its
    events (a consumed batch: once for all its messages); None for a stand-in without one (rebuilt at once)."""
    scratch: dict[str, Any] | None = getattr(tx, "scratch", None)
    if scratch is None or getattr(tx, "after_events", None) is None:
        return None
    jobs: set[str] = scratch.setdefault(_REBUILD, set())
    return jobs


async def _rebuild_after_events(tx: TxLike) -> None:
    """After the fact is written (or held): the rebuild runs now in a unit of one event, at the batch's end in a
    batch."""
    after_events = getattr(tx, "after_events", None)
    if after_events is not None and getattr(tx, "scratch", None) is not None:
        await after_events(_REBUILD, _rebuild_pending)


async def _rebuild_pending(tx: Any) -> None:
    # The held facts first (each job locked before its facts are written), then the rebuild, which must see them.
    # Rebuilding a job whose fact was rolled back with its message's savepoint is harmless: a rebuild is a pure
    # function of the job's facts as the transaction sees them.
    jobs: set[str] = tx.scratch.pop(_REBUILD, set())
    held: _Held | None = tx.scratch.pop(_HELD, None)
    if held is not None:
        jobs |= await store.record_facts_many(tx.conn, held.facts, held.dims)
    await store.rebuild_allocations_many(tx.conn, jobs)


async def on_placed(tx: TxLike, event: CloudEvent, p: JobPlaced) -> None:
    held = _held(tx)
    if held is not None:
        dims, fact = store.placed_rows(p)
        held.dims.append(dims)
        held.facts.append(fact)  # added last: nothing after it can fail
    else:
        await store.record_placed(tx.conn, p, rebuild=_rebuild_set(tx))
    await _rebuild_after_events(tx)


async def on_started(tx: TxLike, event: CloudEvent, p: JobStarted) -> None:
    await _record(tx, p.job_id, FactKind.STARTED, p.started_at)


async def on_completed(tx: TxLike, event: CloudEvent, p: JobCompleted) -> None:
    await _record(tx, p.job_id, FactKind.COMPLETED, p.finished_at,
                            {"exit_reason": p.exit_reason.value})


async def on_failed(tx: TxLike, event: CloudEvent, p: JobFailed) -> None:
    await _record(tx, p.job_id, FactKind.FAILED, p.finished_at, {"exit_reason": p.exit_reason.value})


async def on_attempt_failed(tx: TxLike, event: CloudEvent, p: JobAttemptFailed) -> None:
    # The attempt's allocation ends here and is charged like any other (a failed fact); the retry's placement opens a
    # new allocation, so the attempt's GPU time is charged exactly once.
    await _record(tx, p.job_id, FactKind.FAILED, p.finished_at,
                            {"exit_reason": p.exit_reason.value, "attempt": p.attempt})


async def on_cancelled(tx: TxLike, event: CloudEvent, p: JobCancelled) -> None:
    # cancelled_at is optional; the envelope's time is the producer's statement of when it happened.
    await _record(tx, p.job_id, FactKind.CANCELLED, p.cancelled_at or event.time, {"by": p.by})


async def on_preempted(tx: TxLike, event: CloudEvent, p: JobPreempted) -> None:
    await _record(tx, p.job_id, FactKind.PREEMPTED, p.preempted_at, {
        "lost_ms": round(p.lost_gpu_seconds * 1000), "reason": p.reason.value, "preemptor": p.preemptor})


async def on_resized(tx: TxLike, event: CloudEvent, p: JobResized) -> None:
    # An elastic job grown or shrunk while it runs: its allocation goes on with the pods it has now, from the
    # envelope's time (the scheduler's statement of when it resized the job; the payload carries no instant).
    await _record(tx, p.job_id, FactKind.RESIZED, event.time, store.resize_detail(p))


async def on_sampled(tx: TxLike, event: CloudEvent, p: UtilizationSampled) -> None:
    await store.record_samples(tx.conn, [p])


async def on_queue_config(tx: TxLike, event: CloudEvent, p: QueueConfigChanged) -> None:
    try:
        config = parse_queues(p.config, source=f"QueueConfigChanged {event.id}")
    except ConfigError as exc:
        # Admission rejects and reports an invalid document; metering keeps the prices it has.
        log.warning("metering: ignoring the prices of an invalid queue configuration: %s", exc)
        return
    await store.set_rates(tx.conn, {m: f.cost_per_gpu_hour for m, f in config.gpu_flavors.items()}, event.time)
    await store.set_usage_half_life(tx.conn, _half_life(config.policy.usage_half_life_s), event.time)


def _half_life(value: int | None) -> float | None:
    return float(value) if value is not None else None


# Handlers take a TxLike (tests pass a stand-in): wider than the runtime's Handler, which passes a Tx.
HANDLERS: dict[type[Payload], Callable[[TxLike, CloudEvent, Any], Awaitable[None]]] = {
    JobPlaced: on_placed,
    JobStarted: on_started,
    JobCompleted: on_completed,
    JobFailed: on_failed,
    JobAttemptFailed: on_attempt_failed,
    JobCancelled: on_cancelled,
    JobPreempted: on_preempted,
    JobResized: on_resized,
    UtilizationSampled: on_sampled,
    QueueConfigChanged: on_queue_config,
}
