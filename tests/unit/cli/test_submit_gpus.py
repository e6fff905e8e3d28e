"""`gpuq submit --gpus`: zero, negative and non-whole counts above 1 are refused with one clear line before anything
is published (admission refuses a job without GPUs too: tests/service/admission/test_admission_config_safety.py); a
part of one GPU (0.25) asks a shared GPU (gpu_fraction)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app


@pytest.mark.parametrize("gpus", ["0", "-1", "1.5", "nan", "inf"])
def test_a_gpu_count_that_is_not_a_whole_positive_number_is_refused(gpus: str) -> None:
    # NATS_URL points nowhere: a refusal must come before any connection is tried
    res = CliRunner().invoke(app, ["submit", "--team", "team-a", f"--gpus={gpus}"],
                             env={"NATS_URL": "nats://127.0.0.1:1", "GPUQ_API_URL": "", "COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    assert "give a whole number of GPUs, at least 1" in res.output and "gpuq schedules GPU jobs" in res.output
    assert "NATS" not in res.output


def test_zero_pods_are_refused() -> None:
    res = CliRunner().invoke(app, ["submit", "--team", "team-a", "--pods", "0"],
                             env={"NATS_URL": "nats://127.0.0.1:1", "GPUQ_API_URL": "", "COLUMNS": "300"})
    assert res.exit_code == 2 and "a job has at least 1 pod" in res.output, res.output


def test_a_part_of_one_gpu_asks_a_shared_gpu() -> None:
    from cli.jobs import _spec_from_flags

    spec = _spec_from_flags(team="team-a", queue=None, gpus=0.25, pods=2, gpu_model=[], priority="normal",
                            max_runtime=600, rack=False, name="nb", label=[])
    (ps,) = spec.pod_sets
    assert ps.gpu_fraction == 0.25 and ps.gpus_per_pod == 1 and ps.count == 2 and spec.total_share_milli == 500
