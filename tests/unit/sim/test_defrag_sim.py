"""Defragmentation in the simulator (`gpuq-defrag`): a gang waiting on scattered GPUs starts at once when a
checkpointing job is moved onto the holes; the move's lost work is its own cause; a job that cannot checkpoint is
never moved, so the gang waits as under `gpuq`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.engine import Engine
from sim.metrics import compute_metrics
from sim.model import TraceJob
from sim.run import make_policy

from .conftest import job, trace

WRITE_S = 30.0  # the victim chooser's checkpoint write (VictimChooser's default)


def scattered(checkpoint: int | None) -> list[TraceJob]:
    """Two 8-GPU nodes: a and b fill n-0 (binpack), c and d fill n-1; b and d end at 100, leaving 4 + 4 free. At
    1,000 (past a's protection window) an 8-GPU gang of the same priority arrives; a and c run until 20,000."""
    return [replace(job("a", 0, 20_000, gpus_per_pod=4), checkpoint_interval_s=checkpoint),
            job("b", 0, 100, gpus_per_pod=4),
            replace(job("c", 0, 20_000, gpus_per_pod=4), checkpoint_interval_s=checkpoint),
            job("d", 0, 100, gpus_per_pod=4),
            job("big", 1_000, 500, gpus_per_pod=8)]


def test_a_moved_checkpointing_job_lets_the_gang_start_at_once() -> None:
    runs = {name: Engine(trace(scattered(1800), node_count=2), make_policy(name)).run()
            for name in ("gpuq", "gpuq-defrag")}
    assert runs["gpuq"].records["big"].start == pytest.approx(20_000)  # waits for a or c to end
    moved = runs["gpuq-defrag"].records
    assert moved["big"].start == pytest.approx(1_000)
    # a was moved (n-0 first by name) and restarted in the same instant on n-1's holes, losing only its write
    assert (moved["a"].preemptions, moved["c"].preemptions) == (1, 0)
    assert moved["a"].end == pytest.approx(20_000 + WRITE_S)
    m = compute_metrics(runs["gpuq-defrag"], sim_wall_s=1.0)
    assert m["lost_gpu_hours_by_cause"]["defragmentation"] == pytest.approx(4 * WRITE_S / 3600, abs=1e-3)
    assert m["lost_gpu_hours_by_cause"]["priority"] == m["lost_gpu_hours_by_cause"]["reclaim"] == 0
    assert m["gang_avg_wait_s"] < compute_metrics(runs["gpuq"], sim_wall_s=1.0)["gang_avg_wait_s"]


def test_a_job_that_cannot_checkpoint_is_never_moved() -> None:
    res = Engine(trace(scattered(None), node_count=2), make_policy("gpuq-defrag")).run()
    assert res.records["big"].start == pytest.approx(20_000)
    assert sum(r.preemptions for r in res.records.values()) == 0
