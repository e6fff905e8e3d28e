"""Quotas beyond GPUs in telemetry: their guarantees are a gauge of their own, never a GPU model (the alert on
guarantees above capacity compares gpuq_quota_guaranteed_gpus with the GPUs per model)."""

from __future__ import annotations

from services.core.telemetry.state import TelemetryState, labels
from shared.config import parse_queues
from tests.unit.telemetry.telemetry_builders import T0


def test_cpu_memory_pods_and_pool_guarantees_are_not_gpu_models() -> None:
    s = TelemetryState()
    s.set_queues(parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "queues": [{"name": "a", "quotas": {"H100": {"nominal": 48}, "cpu_milli": {"nominal": 64000},
                                            "pool/spot": {"nominal": 16}}},
                   {"name": "b", "quotas": {"H100": {"nominal": 24}, "cpu_milli": {"nominal": 32000},
                                            "memory_mib": {"nominal": 1024}, "pods": {"nominal": 10}}}],
    }))
    g = s.gauges(T0)
    assert g["gpuq_quota_guaranteed_gpus"] == {labels(gpu_model="H100"): 72}
    assert g["gpuq_quota_guaranteed"] == {labels(resource="cpu_milli"): 96000, labels(resource="memory_mib"): 1024,
                                          labels(resource="pods"): 10, labels(resource="pool/spot"): 16}
