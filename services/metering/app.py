"""The metering service: ledger of allocated / used / idle GPU time, energy, lost work and cost.

Wiring only: the handlers live in handlers.py, the SQL in store.py, the arithmetic in core/."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.metering import store
from services.metering.batch import handle_sample_batch
from services.metering.handlers import HANDLERS
from services.metering.store import MIGRATIONS, SCHEMA
from shared.events import UtilizationSampled, utcnow_from
from shared.service import ServiceRuntime, ServiceSpec

if TYPE_CHECKING:
    from shared.config import QueuesConfig

SPEC = ServiceSpec(name="metering", schema=SCHEMA, migrations=MIGRATIONS, handlers=HANDLERS)


def build_spec(settings: Any) -> ServiceSpec:
    """The spec the stack runs: prices are seeded from the stack's queues.yaml at start (a later
    QueueConfigChanged replaces them)."""
    queues: QueuesConfig | None = getattr(settings, "queues", None)
    rates = {m: f.cost_per_gpu_hour for m, f in queues.gpu_flavors.items()} if queues is not None else None

    async def seed_prices(runtime: ServiceRuntime) -> None:
        if rates is None:
            return
        async with runtime.transaction() as tx:
            await store.set_rates(tx.conn, rates, utcnow_from(tx.now))

    # Samples arrive in pulled batches recorded in one transaction each (services/metering/batch.py).
    handlers = {k: v for k, v in HANDLERS.items() if k is not UtilizationSampled}
    return ServiceSpec(name="metering", schema=SCHEMA, migrations=MIGRATIONS, handlers=handlers,
                       batch_handlers={UtilizationSampled: handle_sample_batch}, on_start=seed_prices)
