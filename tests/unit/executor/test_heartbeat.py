"""The executor's heartbeat: one event per interval listing every job, split into parts when long."""

from __future__ import annotations

from typing import Any

import pytest

from services.executor.heartbeat import Heartbeat, interval_from_env
from shared.events import ExecutorHeartbeat, Payload


class RecordingTx:
    """Stands for the unit of work's `Tx`: records what would be written to the outbox."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self.emitted: list[Payload] = []

    async def emit(self, payload: Payload, *args: Any, **kwargs: Any) -> None:
        self.emitted.append(payload)


async def test_one_heartbeat_lists_every_job_in_parts() -> None:
    beat = Heartbeat("executor/sim", interval_s=10.0)
    tx = RecordingTx()
    jobs = [f"job-{i:05d}" for i in range(9000)]
    assert await beat.emit(tx, 0.0, reversed(jobs), chunk=4000) == 3  # type: ignore[arg-type]  # a recording Tx
    parts = [p for p in tx.emitted if isinstance(p, ExecutorHeartbeat)]
    assert [(p.part, p.parts) for p in parts] == [(0, 3), (1, 3), (2, 3)]
    assert [j for p in parts for j in p.running] == jobs  # each job once, in a stable order


async def test_an_idle_executor_still_beats_and_the_interval_is_kept() -> None:
    beat = Heartbeat("executor/sim", interval_s=10.0)
    tx = RecordingTx()
    assert beat.due(100.0)
    assert await beat.emit(tx, 100.0, []) == 1  # type: ignore[arg-type]  # a recording Tx
    assert isinstance(tx.emitted[0], ExecutorHeartbeat) and tx.emitted[0].running == ()
    assert not beat.due(109.9) and beat.due(110.0)


def test_a_bad_interval_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUQ_HEARTBEAT_INTERVAL_S", "soon")
    with pytest.raises(ValueError, match="GPUQ_HEARTBEAT_INTERVAL_S"):
        interval_from_env()
    monkeypatch.setenv("GPUQ_HEARTBEAT_INTERVAL_S", "0")
    with pytest.raises(ValueError, match="positive"):
        interval_from_env()
