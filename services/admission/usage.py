"""Fair share over time: metering's latest QueueUsageReported (its read model; admission keeps no copy of the
ledger), handed to the core under the policy's half-life and re-applied whenever the state is rebuilt. Memory only:
after a restart the next report (within one period) brings it back."""

from __future__ import annotations

import logging

from services.admission.memory import Memory
from shared.events import QueueUsageReported

log = logging.getLogger("gpuq.admission")


class UsageHistory:
    def __init__(self, memory: Memory):
        self.memory = memory
        self._usage: QueueUsageReported | None = None

    def reported(self, payload: QueueUsageReported) -> bool:
        """Take a report; False for an older report than the one in force (a redelivery, a second metering
        replica), which changes nothing."""
        if self._usage is not None and payload.at <= self._usage.at:
            return False
        self._usage = payload
        return True

    def apply(self) -> None:
        """Hand the latest report to the core when the policy asks for history with the report's half-life (a
        report made under another half-life, before metering saw a configuration change, is not used)."""
        state = self.memory.state
        half_life = state.config.policy.usage_half_life_s
        usage = self._usage
        if half_life is not None and usage is not None and usage.half_life_s == half_life:
            state.set_usage_history(usage.usage, float(half_life))
            return
        if half_life is not None and usage is not None:
            log.warning("admission: ignoring a usage report decayed with a %ss half-life (policy: %ss)",
                        usage.half_life_s, half_life)
        # off, or no usable report: only current usage counts (an empty history clears the historic standing)
        state.set_usage_history({}, float(half_life or 1))
