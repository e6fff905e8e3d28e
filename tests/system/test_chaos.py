"""The bounded chaos test: a few hundred jobs run while each service process is killed and restarted, NATS and
Postgres are restarted, and the active scheduler is paused past its lease; then the invariants hold over the whole
history (gpuq_tools/chaos/harness.py). The harness starts its own NATS and Postgres, so that it can kill them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpuq_tools.chaos.harness import FAULTS, ChaosSettings, Recorded, check_history, run_chaos


@pytest.mark.timeout(900)
def test_invariants_hold_under_faults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = ChaosSettings(jobs=200, arrival_window_s=120.0)
    report = asyncio.run(run_chaos(settings, tmp_path, namespace="chaostest"))
    with capsys.disabled():  # the recovery times, for the record (never asserted: they depend on the machine)
        print("\nchaos recovery times (s):", {f.fault: f.recovery_s and round(f.recovery_s, 1) for f in report.faults},
              "standby takeovers (s):",
              {f.fault: round(f.takeover_s, 1) for f in report.faults if f.takeover_s is not None})
    assert [f.fault for f in report.faults] == list(FAULTS)
    assert report.violations == []
    assert all(f.recovery_s is not None for f in report.faults), report.faults
    assert report.submitted == report.terminal == 200
    assert report.dead_letters >= settings.poison_events  # the injected ones were dead-lettered (and only they)


def _event(seq: int, kind: str, job: str, **data: object) -> Recorded:
    return Recorded(seq=seq, type=f"io.gpuq.job.{kind}.v1", id=f"{kind}-{job}-{seq}", data={"job_id": job, **data})


def _placed(seq: int, job: str, node: str, gpus: tuple[int, ...]) -> Recorded:
    return _event(seq, "placed", job, bindings=[{"node": node, "gpu_indices": list(gpus)}])


def _admitted(seq: int, job: str, queue: str = "q") -> Recorded:
    return _event(seq, "admitted", job, spec={"job_id": job, "queue": queue})


def test_the_history_checks_catch_each_violation() -> None:
    """The checks can fail: a GPU given twice, quota over the limit, a placement never admitted, two terminal
    states, and a job without one."""
    submitted = {"a": ("q", 2), "b": ("q", 2), "c": ("q", 1)}
    clean = [_admitted(1, "a"), _placed(2, "a", "n1", (0, 1)), _event(3, "completed", "a"),
             _admitted(4, "b"), _placed(5, "b", "n1", (0, 1)), _event(6, "completed", "b"),
             _admitted(7, "c"), _placed(8, "c", "n1", (2,)), _event(9, "failed", "c")]
    assert check_history(clean, submitted=submitted, quotas={"q": 3}) == []

    double = [_admitted(1, "a"), _placed(2, "a", "n1", (0, 1)), _admitted(3, "b"), _placed(4, "b", "n1", (1,)),
              _event(5, "completed", "a"), _event(6, "completed", "b"), _admitted(7, "c"), _placed(8, "c", "n2", (0,)),
              _event(9, "completed", "c"), _event(10, "completed", "c")]
    found = check_history(double, submitted=submitted, quotas={"q": 3})
    assert any("GPU n1/1 given to b while a holds it" in v for v in found)
    assert any("queue q uses 4 GPUs, quota 3" in v for v in found)
    assert any(v.startswith("c: 2 terminal events") for v in found)

    unadmitted = [_placed(1, "a", "n1", (0,)), _event(2, "completed", "a")]
    found = check_history(unadmitted, submitted=submitted, quotas={"q": 3})
    assert any("a placed without being admitted" in v for v in found)
    assert any(v.startswith("b: 0 terminal events") for v in found)
