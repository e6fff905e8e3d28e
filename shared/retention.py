"""How long the platform keeps the history that grows without bound, and the loop that prunes it.

Two tables grow with time rather than with the work in flight: metering's raw GPU samples (`metering.gpu_samples`,
already rolled up into `metering.usage_hourly` as they arrive, which the reports read) and the audit trail
(`audit.records`, partitioned by month, dropped a whole month at a time). Each has a window, in days, from the
environment of the service that prunes it (the chart's `retention` values); 0 keeps everything. A window below its
floor is refused at start with the reason: the floors protect correctness (a raw sample must outlive every
redelivery of it, or it would be counted twice) or the audit trail's purpose. docs/install.md, "Backups and
retention".
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.settings import settings

if TYPE_CHECKING:
    from shared.service import ServiceRuntime

log = logging.getLogger("gpuq.retention")

DAY_S = 86_400.0
# How often each service prunes (platform time), and how often its loop looks at the clock (wall time).
RETENTION_EVERY_S = 3_600.0
RETENTION_POLL_S = 5.0


@dataclass(frozen=True)
class Window:
    """A retention window's variable; its default, floor and why are shared/settings.py's."""

    env: str

    def days(self, env: Mapping[str, str] = os.environ) -> int | None:
        """The window in days from the environment (default when unset); None: keep everything (0)."""
        value: int = getattr(settings(env), self.env.removeprefix("GPUQ_").lower())
        return value or None


# The utilisation stream keeps a sample two days (shared/bus.py); a sample published late is redelivered up to
# then, so a raw row is kept a day longer than that (floor: 3 days): its primary key is what makes a redelivery
# count once.
METERING_RAW = Window("GPUQ_METERING_RAW_RETENTION_DAYS")
# The audit trail's legal window. The database refuses to drop a month that ended less than 30 days ago
# (audit.drop_partitions_before), whatever a caller asks (floor: 30 days).
AUDIT = Window("GPUQ_AUDIT_RETENTION_DAYS")


async def periodically(runtime: ServiceRuntime, work: Callable[[float], Awaitable[object]], *,
                       every_s: float = RETENTION_EVERY_S, poll_s: float = RETENTION_POLL_S) -> None:
    """Run `work(now)` at start and then every `every_s` of the runtime's clock. A pass that fails is logged and
    tried again at the next period (not at once: a refusal would only repeat)."""
    last: float | None = None
    while True:
        now = runtime.clock.now()
        if last is None or now - last >= every_s:
            last = now
            try:
                await work(now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: retention pass failed; trying again in %.0f s", runtime.spec.name, every_s)
        await asyncio.sleep(poll_s)
