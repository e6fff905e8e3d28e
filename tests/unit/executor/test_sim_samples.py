"""The simulated executor's utilisation samples (services/executor/sim.py `sample_payloads`)."""

from __future__ import annotations

import pytest

from services.executor.sim import (
    SAMPLE_INTERVAL_ENV,
    SimExecutor,
    SimExecutorSettings,
    jitter,
    sample_interval_from_env,
    sample_payloads,
)
from shared.config import parse_cluster
from shared.domain import JobSpec, PodSet
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
    # A run holding no GPU (pods that ask for none) is not sampled: it would be charged GPU time and energy.
    assert sample_payloads([("cpu", 1, ["n0"])], {("cpu", 1): (50.0, 0)}, {"n0": "H100"}, NOW, 5.0) == []


class _Conn:
    """The two reads `_sample` makes: the running runs, then the specs of those it has not seen."""

    def __init__(self, spec_json: str):
        self.spec_json = spec_json

    async def fetch(self, query: str, *args: object) -> list[dict[str, object]]:
        if "spec" in query:
            return [{"job_id": "a", "attempt": 1, "spec": self.spec_json}]
        return [{"job_id": "a", "attempt": 1, "nodes": ["n-0"]}]


class _Tx:
    def __init__(self, conn: _Conn, now: float):
        self.conn, self.now = conn, now
        self.emitted: list[UtilizationSampled] = []

    async def emit(self, payload: UtilizationSampled, subject_suffix: str | None = None) -> None:
        self.emitted.append(payload)


CLUSTER = parse_cluster({"node_groups": [{"name": "n", "count": 2, "gpus_per_node": 2, "gpu_model": "H100-80GB",
                                          "cpu_milli": 1000, "memory_mib": 1024}]})


@pytest.mark.parametrize("env, every", [(None, 1.0), ("30", 30.0), ("0.5", 0.5)])
def test_the_sampling_interval_comes_from_the_settings_or_the_environment(
        monkeypatch: pytest.MonkeyPatch, env: str | None, every: float) -> None:
    if env is None:
        monkeypatch.delenv(SAMPLE_INTERVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(SAMPLE_INTERVAL_ENV, env)
    assert SimExecutor(SimExecutorSettings(cluster=CLUSTER)).sample_every_s == every
    assert SimExecutor(SimExecutorSettings(cluster=CLUSTER, sample_every_s=7.0)).sample_every_s == 7.0


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "inf", "nan"])
def test_a_sampling_interval_that_is_no_positive_number_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                  raw: str) -> None:
    monkeypatch.setenv(SAMPLE_INTERVAL_ENV, raw)
    with pytest.raises(ValueError, match=SAMPLE_INTERVAL_ENV):
        sample_interval_from_env()


async def test_each_batch_covers_the_time_since_the_last_whatever_the_interval() -> None:
    """Metering integrates `interval_s`: the first batch covers one nominal interval, each later one the time
    since the one before it (the services' time), so GPU-seconds add up to the time sampled at any cadence."""
    executor = SimExecutor(SimExecutorSettings(cluster=CLUSTER, sample_every_s=30.0))
    spec = JobSpec(job_id="a", team="t", queue="t", pod_sets=(PodSet(count=1, gpus_per_pod=2),))
    conn = _Conn(spec.model_dump_json())
    intervals = []
    for now in (NOW, NOW + 30.0, NOW + 75.0):
        tx = _Tx(conn, now)
        await executor._sample(tx, wall=now)  # type: ignore[arg-type]  # the two calls it makes of a Tx
        assert [p.node for p in tx.emitted] == ["n-0"] and len(tx.emitted[0].samples) == 2
        intervals.append(tx.emitted[0].interval_s)
    assert intervals == [30.0, 30.0, 45.0]
