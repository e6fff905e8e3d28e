"""The metering service: ledger of allocated / used / idle GPU time, energy, lost work and cost.

Wiring only: the handlers live in handlers.py, the SQL in store.py, the arithmetic in core/."""

from __future__ import annotations

from services.metering.handlers import HANDLERS
from services.metering.store import MIGRATIONS, SCHEMA
from shared.service import ServiceSpec

SPEC = ServiceSpec(name="metering", schema=SCHEMA, migrations=MIGRATIONS, handlers=HANDLERS)
