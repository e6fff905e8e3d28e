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

import re
from datetime import UTC, datetime

from shared.domain import GpuBinding, JobSpec

MILLI_GPU = 1000
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
MS_PER_KWH_MJ = 3_600_000_000  # millijoules per kWh
MIG_COMPUTE_SLICES = 7  # A100/H100 GPUs have 7 compute slices; a `3g.40gb` slice is 3/7 of a GPU
_MIG_PROFILE_RE = re.compile(r"^(\d+)g\.")


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


def mig_milli_gpus(profile: str | None) -> int:
    """GPU share of one MIG slice of `profile` (`1g.10gb` → 142 milli-GPUs); unknown shapes count as 1g."""
    m = _MIG_PROFILE_RE.match(profile or "")
    compute = int(m.group(1)) if m else 1
    return min(MILLI_GPU, compute * MILLI_GPU // MIG_COMPUTE_SLICES)


def binding_milli_gpus(binding: GpuBinding, spec: JobSpec) -> int:
    """Milli-GPUs one pod binding holds: whole GPUs ×1000, or the MIG share of its pod set's profile."""
    if binding.gpu_indices:
        return len(binding.gpu_indices) * MILLI_GPU
    if binding.mig_slice is not None:
        pod_set = binding.pod.rsplit("-", 1)[0]
        profile = next((p.mig_profile for p in spec.pod_sets if p.name == pod_set), None)
        if profile is None:  # pod name not in the spec: take the job's only MIG profile, if there is one
            profiles = sorted({p.mig_profile for p in spec.pod_sets if p.mig_profile})
            profile = profiles[0] if profiles else None
        return mig_milli_gpus(profile)
    return 0


def node_shares(bindings: tuple[GpuBinding, ...] | list[GpuBinding], spec: JobSpec) -> tuple[tuple[str, int], ...]:
    """Milli-GPUs per node of a placement, sorted by node name; nodes holding no GPU are left out."""
    per_node: dict[str, int] = {}
    for b in bindings:
        per_node[b.node] = per_node.get(b.node, 0) + binding_milli_gpus(b, spec)
    return tuple((node, milli) for node, milli in sorted(per_node.items()) if milli > 0)


def model_hint(spec: JobSpec) -> str | None:
    """The GPU model a job must run on when its spec leaves no choice (used when a node's model is unknown)."""
    models = spec.gpu_models
    return models[0] if len(models) == 1 else None


def sample_used_gpu_ms(utilization_pct: float, interval_ms: int) -> int:
    """GPU-milliseconds of useful work in one sample: utilisation × the interval it covers."""
    return round(utilization_pct * interval_ms / 100)


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
