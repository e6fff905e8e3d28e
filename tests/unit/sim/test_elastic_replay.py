"""Elastic jobs in the simulator (sim/elastic.py, the engine's goodput): an elastic job starts with the pods that
fit, runs at the goodput of its size (linear by default, or its own curve), and finishes sooner once it grows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sim.engine import Engine
from sim.model import goodput
from sim.run import make_policy
from tests.unit.sim.conftest import job, trace


def ends(policy: str, curve: tuple[float, ...] = ()) -> dict[str, float | None]:
    # 8 GPUs: a (4 GPUs) and b (6 GPUs) arrive together for 100 s of work each; a is placed first (id order)
    tr = trace([job("a", 0, 100, gpus_per_pod=4), replace(job("b", 0, 100, gpus_per_pod=6), goodput=curve)])
    res = Engine(tr, make_policy(policy)).run()
    return {j: r.end for j, r in res.records.items()}


def test_the_fixed_twin_waits_for_the_whole_gang() -> None:
    assert ends("gpuq-pods1") == {"a": 100.0, "b": 200.0}


def test_an_elastic_job_starts_with_what_fits_and_grows_when_gpus_free() -> None:
    # b starts with 4 of its 6 pods (linear: 4/6 of its speed), has done 66.7 s of work when a ends at 100 s,
    # then grows to 6 and does the last 33.3 s at full speed
    got = ends("gpuq-elastic")
    assert got["a"] == 100.0
    assert got["b"] == pytest.approx(100 + 100 / 3)


def test_a_goodput_curve_of_its_own_sets_the_speed_of_a_smaller_size() -> None:
    # with 4 pods this job does 90% of its full speed (sublinear scaling): 90 s of work by t=100, 10 s after
    curve = (0.3, 0.55, 0.75, 0.9, 0.97, 1.0)
    assert goodput(replace(job("x", 0, 1), goodput=curve), 4, 6) == 0.9
    assert goodput(job("x", 0, 1), 4, 6) == pytest.approx(4 / 6)  # none given: linear
    assert ends("gpuq-elastic", curve)["b"] == pytest.approx(110.0)
