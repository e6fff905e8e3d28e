"""Fixed-point units of the ledger, and the per-sample / per-binding arithmetic.

Every quantity the ledger stores is an integer so that sums are exact and independent of the order in which
events arrive (float sums are not associative: a shuffled replay could differ in the last bit):

- time in milliseconds since the epoch (`*_ms`);
- GPU time in GPU-milliseconds (`gpu_ms`): one whole GPU held for one second is 1,000 gpu_ms;
- GPU share of an allocation in milli-GPUs (a whole GPU is 1,000; a MIG slice `Ng.*` is N·1000 // 7);
- energy in millijoules (W × ms).

Floats appear only at the edge: when a sample is converted (rounded once, deterministically) and when a
report turns integers into hours, kWh and money.
"""

from __future__ import annotations

from datetime import UTC, datetime

# GPU shares of slices and bindings are domain facts (the DCGM source and telemetry's MFU need them too); the
# ledger's callers keep importing them from here.
from shared.domain import MILLI_GPU, JobSpec, binding_milli_gpus, mig_milli_gpus, node_shares

__all__ = ["MILLI_GPU", "binding_milli_gpus", "mig_milli_gpus", "node_shares"]

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
MS_PER_KWH_MJ = 3_600_000_000  # millijoules per kWh


def to_ms(ts: datetime) -> int:
    """Epoch milliseconds of an aware datetime (naive datetimes are taken as UTC)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    delta = ts - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def floor_to(ms: int, step_ms: int) -> int:
    return ms - ms % step_ms


def ceil_to(ms: int, step_ms: int) -> int:
    return -((-ms) // step_ms) * step_ms


def model_hint(spec: JobSpec) -> str | None:
    """The GPU model a job must run on when its spec leaves no choice (used when a node's model is unknown)."""
    models = spec.gpu_models
    return models[0] if len(models) == 1 else None


def sample_used_gpu_ms(utilization_pct: float, interval_ms: int, milli_gpus: int = MILLI_GPU) -> int:
    """GPU-milliseconds of useful work in one sample: utilisation × the interval it covers × the share of a GPU
    sampled (a MIG instance's utilisation is of its slice)."""
    if milli_gpus == MILLI_GPU:
        return round(utilization_pct * interval_ms / 100)
    return round(utilization_pct * interval_ms * milli_gpus / (100 * MILLI_GPU))


def sample_energy_mj(power_w: float, interval_ms: int) -> int:
    """Energy of one sample in millijoules: W × ms."""
    return round(power_w * interval_ms)


def gpu_ms_to_hours(gpu_ms: int) -> float:
    return gpu_ms / HOUR_MS


def mj_to_kwh(mj: int) -> float:
    return mj / MS_PER_KWH_MJ


def split_lost(lost_ms: int, shares: tuple[tuple[str, int], ...]) -> list[int]:
    """Apportion `lost_ms` over nodes by milli-GPU share, exactly (largest remainder, ties by node order)."""
    total = sum(m for _, m in shares)
    if not shares:
        return []
    if total == 0:
        return [lost_ms] + [0] * (len(shares) - 1)
    parts = [lost_ms * m // total for _, m in shares]
    remainders = sorted(range(len(shares)), key=lambda i: (-(lost_ms * shares[i][1] % total), i))
    for i in remainders[: lost_ms - sum(parts)]:
        parts[i] += 1
    return parts
