"""The shapes the telemetry core reports in: label sets, counter/histogram observations, gauge snapshots."""

from __future__ import annotations

from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]
Gauges = dict[str, dict[Labels, float]]


def labels(**kv: str) -> Labels:
    return tuple(sorted(kv.items()))


@dataclass(frozen=True)
class Observation:
    """A counter increment (`kind="counter"`) or a histogram observation (`kind="histogram"`)."""

    kind: str
    name: str
    value: float
    labels: Labels


@dataclass
class Effects:
    """What one event changed: observations for the metrics layer, and which records to persist."""

    observations: list[Observation] = field(default_factory=list)
    jobs: set[str] = field(default_factory=set)  # upsert if still present, else delete
    nodes: set[str] = field(default_factory=set)
    samples: set[str] = field(default_factory=set)
    sources: set[str] = field(default_factory=set)
    quotas: bool = False

    def count(self, name: str, value: float = 1.0, **kv: str) -> None:
        self.observations.append(Observation("counter", name, value, labels(**kv)))

    def observe(self, name: str, value: float, **kv: str) -> None:
        self.observations.append(Observation("histogram", name, max(0.0, value), labels(**kv)))


__all__ = ["Effects", "Gauges", "Labels", "Observation", "labels"]
