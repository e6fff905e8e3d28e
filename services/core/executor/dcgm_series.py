"""dcgm-exporter series as Prometheus returns them → one reading per GPU device (a whole GPU or a MIG instance).

What is read (docs/observability.md, "GPU utilisation from DCGM"), one PromQL query per field:

| field | unit | use |
|---|---|---|
| DCGM_FI_PROF_GR_ENGINE_ACTIVE | ratio 0..1 | utilisation (works for whole GPUs and MIG instances) |
| DCGM_FI_DEV_GPU_UTIL | % | utilisation fallback for whole GPUs (not meaningful per MIG instance) |
| DCGM_FI_DEV_FB_USED / _FB_FREE | MiB | memory used / free |
| DCGM_FI_DEV_POWER_USAGE | W | energy (a MIG instance gets its share of the parent GPU's power) |
| DCGM_FI_DEV_GPU_TEMP | °C | temperature |
| DCGM_FI_PROF_PIPE_TENSOR_ACTIVE | ratio 0..1 | tensor-pipe activity, the MFU proxy |
| DCGM_FI_DEV_XID_ERRORS | last XID code | GPU health |

Every field but the XID is averaged over the lookback window (`avg_over_time`), so a sample covers the interval
instead of one instant; the XID takes the window's maximum so that a short-lived error is not missed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from shared.config import DcgmLabels, DcgmSettings


class DcgmField(StrEnum):
    GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
    FB_USED = "DCGM_FI_DEV_FB_USED"
    FB_FREE = "DCGM_FI_DEV_FB_FREE"
    POWER = "DCGM_FI_DEV_POWER_USAGE"
    TEMP = "DCGM_FI_DEV_GPU_TEMP"
    TENSOR_ACTIVE = "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"
    XID = "DCGM_FI_DEV_XID_ERRORS"


def queries(settings: DcgmSettings) -> dict[DcgmField, str]:
    """The PromQL expression of every field (window in whole seconds, selector from the settings)."""
    window = f"{max(1, round(settings.window_s))}s"
    selector = f"{{{settings.selector}}}" if settings.selector else ""
    return {f: f"{'max' if f is DcgmField.XID else 'avg'}_over_time({f.value}{selector}[{window}])"
            for f in DcgmField}


@dataclass(frozen=True, order=True)
class Device:
    """One GPU device as DCGM names it: node, GPU index and, for a MIG instance, its GPU instance id."""

    node: str
    gpu: int
    instance: int | None = None

    def sort_key(self) -> tuple[str, int, int]:
        return self.node, self.gpu, -1 if self.instance is None else self.instance


@dataclass
class DeviceReading:
    device: Device
    uuid: str | None = None
    profile: str | None = None  # MIG profile of the instance (GPU_I_PROFILE)
    pod: tuple[str, str] | None = None  # (namespace, pod) of the workload using the device, when labelled
    values: dict[DcgmField, float] = field(default_factory=dict)

    def get(self, f: DcgmField) -> float | None:
        return self.values.get(f)


@dataclass
class ParsedSeries:
    readings: dict[Device, DeviceReading] = field(default_factory=dict)
    series: int = 0
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> series

    def by_node(self) -> dict[str, list[DeviceReading]]:
        out: dict[str, list[DeviceReading]] = {}
        for dev in sorted(self.readings, key=Device.sort_key):
            out.setdefault(dev.node, []).append(self.readings[dev])
        return dict(sorted(out.items()))


def _first(labels: Mapping[str, str], names: Sequence[str]) -> str | None:
    for name in names:
        value = labels.get(name, "")
        if value:
            return value
    return None


def _int(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def _pod(labels: Mapping[str, str], names: DcgmLabels) -> tuple[str, str] | None:
    # A pair counts only when both labels are set: dcgm-exporter writes pod="" on GPUs no pod uses.
    for pair in names.pods:
        ns, pod = labels.get(pair.namespace, ""), labels.get(pair.pod, "")
        if ns and pod:
            return ns, pod
    return None


def parse_results(results: Mapping[DcgmField, Sequence[Mapping[str, Any]]], names: DcgmLabels) -> ParsedSeries:
    """Fold the instant-vector results of every field (`data.result` of /api/v1/query) into device readings.

    A series is dropped, and counted by reason, when it names no node, no (valid) GPU index, or has no finite
    value; it is never guessed into place."""
    out = ParsedSeries()
    for f in sorted(results, key=lambda f: f.value):
        for item in results[f]:
            out.series += 1
            labels = item.get("metric") or {}
            node = _first(labels, names.node)
            if node is None:
                out.dropped["no node label"] += 1
                continue
            gpu = _int(labels.get(names.gpu))
            if gpu is None:
                out.dropped["no gpu label"] += 1
                continue
            raw_instance = labels.get(names.gpu_instance, "")
            instance = _int(raw_instance)
            if raw_instance and instance is None:
                out.dropped["bad GPU instance label"] += 1
                continue
            try:
                value = float(item["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                out.dropped["no value"] += 1
                continue
            if not math.isfinite(value) or value < 0:
                out.dropped["value not finite or negative"] += 1
                continue
            dev = Device(node, gpu, instance)
            reading = out.readings.get(dev)
            if reading is None:
                reading = out.readings[dev] = DeviceReading(dev)
            reading.values[f] = value
            reading.uuid = reading.uuid or labels.get(names.uuid) or None
            reading.profile = reading.profile or labels.get(names.gpu_instance_profile) or None
            reading.pod = reading.pod or _pod(labels, names)
    return out
