"""Pure telemetry core: event folding, gauge snapshots, fragmentation (no I/O, no clock reads)."""

from services.core.telemetry.names import METRICS, MetricDef
from services.core.telemetry.state import Effects, Observation, TelemetryState

__all__ = ["METRICS", "Effects", "MetricDef", "Observation", "TelemetryState"]
