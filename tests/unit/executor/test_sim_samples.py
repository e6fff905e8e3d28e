"""The simulated executor's utilisation samples (services/executor/sim.py `sample_payloads`)."""

from __future__ import annotations

from services.executor.sim import jitter, sample_payloads
from shared.events import GpuSample, UtilizationSampled, utcnow_from

NOW = 1_767_225_600.0


def test_one_payload_per_busy_node_with_each_gpu_of_each_run() -> None:
    runs = [("b", 1, ["n1"]), ("a", 2, ["n0", "n1"]), ("gone", 1, ["n2"])]
    specs = {("a", 2): (70.0, 4), ("b", 1): (99.0, 2), ("gone", 7): (50.0, 8)}  # "gone" placed again since
    got = sample_payloads(runs, specs, {"n0": "H100", "n1": "A100", "n2": "L4"}, NOW, 5.0)

    def gpu(job: str, jitter_gpu: int, index: int, util: float) -> GpuSample:
        value = min(100.0, max(0.0, util + jitter(job, jitter_gpu, NOW)))
        return GpuSample(job_id=job, gpu_index=index, utilization_pct=value, memory_used_mib=int(value * 600),
                         power_w=round(80 + 6 * value, 1))

    assert got == [
        UtilizationSampled(node="n0", gpu_model="H100", sampled_at=utcnow_from(NOW), interval_s=5.0, source="sim",
                           samples=(gpu("a", 0, 0, 70.0), gpu("a", 1, 1, 70.0))),
        UtilizationSampled(node="n1", gpu_model="A100", sampled_at=utcnow_from(NOW), interval_s=5.0, source="sim",
                           samples=(gpu("a", 0, 0, 70.0), gpu("a", 1, 1, 70.0), gpu("b", 0, 2, 99.0),
                                    gpu("b", 1, 3, 99.0))),
    ]
    assert all(0.0 <= s.utilization_pct <= 100.0 for p in got for s in p.samples)
    assert sample_payloads([], specs, {}, NOW, 5.0) == []
