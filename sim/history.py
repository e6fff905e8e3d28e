"""Usage decayed with a half-life, as a metering ledger's history is read for fair share over time (Slurm's
PriorityDecayHalfLife): each GPU-second used `a` seconds ago counts 2^(−a/H). Used by the `slurm` baseline
(per account) and by `gpuq-fairtime` (per queue and quota resource, handed to the admission core)."""

from __future__ import annotations

import math


class DecayedUsage:
    """Per-account GPU-seconds decayed with a half-life: each GPU-second used `a` seconds ago counts 2^(−a/H).
    Advanced lazily: running allocations integrate exactly between two reads."""

    def __init__(self, half_life_s: float):
        self.rate = math.log(2) / half_life_s
        self.usage: dict[str, float] = {}
        self.gpus: dict[str, float] = {}  # account -> GPUs held now
        self.at = 0.0

    def advance(self, now: float) -> None:
        dt = now - self.at
        if dt <= 0:
            return
        decay = math.exp(-self.rate * dt)
        grown = (1 - decay) / self.rate  # ∫_0^dt e^(−rate·(dt−s)) ds
        for account in sorted(set(self.usage) | set(self.gpus)):
            self.usage[account] = self.usage.get(account, 0.0) * decay + self.gpus.get(account, 0.0) * grown
        self.at = now

    def hold(self, account: str, gpus: float, now: float) -> None:
        self.advance(now)
        self.gpus[account] = self.gpus.get(account, 0.0) + gpus
