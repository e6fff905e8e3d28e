"""The metering service: ledger of allocated / used / idle GPU time, energy, lost work and cost.

Wiring only: the handlers live in handlers.py, the SQL in store.py, the arithmetic in core/."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from services.metering import store
from services.metering.batch import handle_sample_batch
from services.metering.budgets import report_budgets
from services.metering.handlers import HANDLERS
from services.metering.store import MIGRATIONS, SCHEMA
from shared.events import QueueUsageReported, UtilizationSampled, utcnow_from
from shared.retention import DAY_S, METERING_RAW, periodically
from shared.service import READER_LINGER_S, ServiceRuntime, ServiceSpec

if TYPE_CHECKING:
    from shared.config import QueuesConfig

log = logging.getLogger("gpuq.metering")

SPEC = ServiceSpec(name="metering", schema=SCHEMA, migrations=MIGRATIONS, handlers=HANDLERS)


def build_spec(settings: Any) -> ServiceSpec:
    """The spec the stack runs: prices are seeded from the stack's queues.yaml at start (a later
    QueueConfigChanged replaces them)."""
    queues: QueuesConfig | None = getattr(settings, "queues", None)
    raw_days = METERING_RAW.days(os.environ)  # refused here, at start, when below its floor
    rates = {m: f.cost_per_gpu_hour for m, f in queues.gpu_flavors.items()} if queues is not None else None

    half_life = queues.policy.usage_half_life_s if queues is not None else None

    async def seed_prices(runtime: ServiceRuntime) -> None:
        if queues is None:
            return
        async with runtime.transaction() as tx:
            await store.set_rates(tx.conn, rates or {}, utcnow_from(tx.now))
            await store.set_usage_half_life(tx.conn, float(half_life) if half_life else None, utcnow_from(tx.now))

    # Samples arrive in pulled batches recorded in one transaction each (services/metering/batch.py). Their
    # per-message handler stays registered: a batch that fails as a whole falls back to one message at a time,
    # and a sample with no handler there would be acked as ignored, i.e. lost.
    return ServiceSpec(name="metering", schema=SCHEMA, migrations=MIGRATIONS, handlers=dict(HANDLERS),
                       batch_handlers={UtilizationSampled: handle_sample_batch}, on_start=seed_prices,
                       background=(report_usage, report_budgets,
                                   *([] if raw_days is None else [sample_retention(raw_days)])),
                       optimistic_batches=True,  # no memory: its facts are tables
                       batch_linger_s=READER_LINGER_S)


# Fair share over time: how often the decayed usage per queue is published, in platform time (Slurm recomputes
# its fair-share factors every PriorityCalcPeriod, 5 minutes by default); how often the loop looks, in wall time.
USAGE_REPORT_PERIOD_S = 300.0
USAGE_POLL_S = 0.5


async def report_usage(runtime: ServiceRuntime, period_s: float = USAGE_REPORT_PERIOD_S,
                       poll_s: float = USAGE_POLL_S) -> None:
    """Publish QueueUsageReported, metering's read model of each queue's decayed usage, at start and then every
    `period_s` of platform time while policy.usage_half_life_s is set (admission orders queues with it; it never
    reads metering's tables)."""
    last: float | None = None
    while True:
        now = runtime.clock.now()
        if last is None or now - last >= period_s:
            last = now
            # read outside the unit-of-work lock (a read of the ledger must not hold up event handling), then
            # publish through the outbox
            at = utcnow_from(now)
            async with runtime.pool.acquire() as conn:
                half_life_s = await store.usage_half_life(conn)
                usage = await store.decayed_usage(conn, at, half_life_s) if half_life_s is not None else None
            if half_life_s is not None and usage is not None:
                async with runtime.transaction() as tx:
                    await tx.emit(QueueUsageReported(at=at, half_life_s=half_life_s, usage=usage))
        await asyncio.sleep(poll_s)


def sample_retention(days: int) -> Callable[[ServiceRuntime], Coroutine[Any, Any, None]]:
    """The loop that deletes raw GPU samples older than `days` (GPUQ_METERING_RAW_RETENTION_DAYS), hourly: the hourly
    rollups the reports read stay, so the reports do not change."""
    async def prune(runtime: ServiceRuntime) -> None:
        async def once(now: float) -> None:
            async with runtime.pool.acquire() as conn:
                deleted = await store.prune_samples(conn, utcnow_from(now - days * DAY_S))
            if deleted:
                log.info("metering: deleted %d raw GPU samples older than %d days", deleted, days)

        await periodically(runtime, once)

    return prune
