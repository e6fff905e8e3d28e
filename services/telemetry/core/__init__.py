"""Pure telemetry core: event folding, gauge snapshots, fragmentation (no I/O, no clock reads)."""

from services.telemetry.core.names import METRICS, MetricDef
from services.telemetry.core.state import Effects, Observation, TelemetryState

__all__ = ["METRICS", "Effects", "MetricDef", "Observation", "TelemetryState"]
