"""UtilizationSampled batches → the column arrays the store inserts in one statement (unnest)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.metering.core.units import sample_energy_mj, sample_used_gpu_ms
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

    def __len__(self) -> int:
        return len(self.node)

    def arrays(self) -> tuple[list[Any], ...]:
        return (self.node, self.gpu_index, self.sampled_at, self.job_id, self.interval_ms, self.utilization_pct,
                self.memory_used_mib, self.power_w, self.temperature_c, self.used_gpu_ms, self.energy_mj,
                self.model_node, self.model_name)


def sample_columns(events: Iterable[UtilizationSampled]) -> SampleColumns:
    """One row per GPU sample. The used time and energy are rounded here, once, so that every replica and
    every replay stores the same integers for the same sample."""
    cols = SampleColumns()
    for ev in events:
        interval_ms = round(ev.interval_s * 1000)
        if ev.gpu_model:
            cols.model_node.append(ev.node)
            cols.model_name.append(ev.gpu_model)
        for s in ev.samples:
            cols.node.append(ev.node)
            cols.gpu_index.append(s.gpu_index)
            cols.sampled_at.append(ev.sampled_at)
            cols.job_id.append(s.job_id or None)
            cols.interval_ms.append(interval_ms)
            cols.utilization_pct.append(s.utilization_pct)
            cols.memory_used_mib.append(s.memory_used_mib)
            cols.power_w.append(s.power_w)
            cols.temperature_c.append(s.temperature_c)
            cols.used_gpu_ms.append(sample_used_gpu_ms(s.utilization_pct, interval_ms))
            cols.energy_mj.append(sample_energy_mj(s.power_w, interval_ms))
    return cols
