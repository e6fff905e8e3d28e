"""UtilizationSampled batches → the column arrays the store inserts in one statement (unnest)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.core.metering.units import MILLI_GPU, mig_milli_gpus, sample_energy_mj, sample_used_gpu_ms
from shared.events import UtilizationSampled


@dataclass
class SampleColumns:
    node: list[str] = field(default_factory=list)
    gpu_index: list[int] = field(default_factory=list)
    sampled_at: list[datetime] = field(default_factory=list)
    job_id: list[str | None] = field(default_factory=list)
    interval_ms: list[int] = field(default_factory=list)
    utilization_pct: list[float] = field(default_factory=list)
    memory_used_mib: list[int] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    temperature_c: list[float | None] = field(default_factory=list)
    used_gpu_ms: list[int] = field(default_factory=list)
    energy_mj: list[int] = field(default_factory=list)
    model_node: list[str] = field(default_factory=list)  # nodes whose GPU model the events name
    model_name: list[str] = field(default_factory=list)
    gpu_instance: list[int] = field(default_factory=list)  # MIG GPU instance id, -1 for a whole GPU
    milli_gpus: list[int] = field(default_factory=list)  # share of a GPU the sample covers
    approximate: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.node)

    def arrays(self) -> tuple[list[Any], ...]:
        return (self.node, self.gpu_index, self.sampled_at, self.job_id, self.interval_ms, self.utilization_pct,
                self.memory_used_mib, self.power_w, self.temperature_c, self.used_gpu_ms, self.energy_mj,
                self.model_node, self.model_name, self.gpu_instance, self.milli_gpus, self.approximate)


def sample_columns(events: Iterable[UtilizationSampled]) -> SampleColumns:
    """One row per GPU sample (per MIG instance on a partitioned GPU). The used time and energy are rounded
    here, once, so that every replica and every replay stores the same integers for the same sample. A MIG
    instance's used time is weighted by its slice's share of the GPU, as its allocation is."""
    cols = SampleColumns()
    for ev in events:
        interval_ms = round(ev.interval_s * 1000)
        if ev.gpu_model:
            cols.model_node.append(ev.node)
            cols.model_name.append(ev.gpu_model)
        for s in ev.samples:
            milli = mig_milli_gpus(s.mig_profile) if s.gpu_instance is not None else MILLI_GPU
            cols.node.append(ev.node)
            cols.gpu_index.append(s.gpu_index)
            cols.sampled_at.append(ev.sampled_at)
            cols.job_id.append(s.job_id or None)
            cols.interval_ms.append(interval_ms)
            cols.utilization_pct.append(s.utilization_pct)
            cols.memory_used_mib.append(s.memory_used_mib)
            cols.power_w.append(s.power_w)
            cols.temperature_c.append(s.temperature_c)
            cols.used_gpu_ms.append(sample_used_gpu_ms(s.utilization_pct, interval_ms, milli))
            cols.energy_mj.append(sample_energy_mj(s.power_w, interval_ms))
            cols.gpu_instance.append(-1 if s.gpu_instance is None else s.gpu_instance)
            cols.milli_gpus.append(milli)
            cols.approximate.append(s.approximate)
    return cols
