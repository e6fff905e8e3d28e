"""`gpuq simulate` warns on stderr, in one line, when the trace's offered load is too low for policies to differ
(the README's former example ran at 0.01: every policy identical, zero waits, and nothing said so)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from sim.cli import LOW_LOAD, low_load_warning


def _simulate(tmp_path: Path, jobs: int, duration: int) -> tuple[int, str, str]:
    trace = tmp_path / "t.csv"
    # one 8-GPU job every 100 s on 32 GPUs: offered load = jobs × 8 × duration / (32 × span)
    trace.write_text("job_id,submit_time,duration,gpus,team\n"
                     + "".join(f"j{i},{i * 100},{duration},8,team-a\n" for i in range(jobs)))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("node_groups:\n  - {name: h, count: 4, gpus_per_node: 8, gpu_model: H100, cpu_milli: 96000,"
                       " memory_mib: 1048576}\n")
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--cluster", str(cluster), "--policy",
                                   "quota-fifo"])
    return res.exit_code, res.stdout, res.stderr


def test_a_trace_below_the_threshold_gets_one_warning_line_on_stderr(tmp_path: Path) -> None:
    code, out, err = _simulate(tmp_path, jobs=20, duration=10)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and f"is below {LOW_LOAD}" in lines[0] and "--load" in lines[0], err
    assert "warning" not in out


def test_a_loaded_trace_gets_none(tmp_path: Path) -> None:
    code, _, err = _simulate(tmp_path, jobs=20, duration=2000)
    assert code == 0, err
    assert "warning" not in err, err


def test_the_threshold() -> None:
    assert low_load_warning(0.01) is not None and low_load_warning(0.29) is not None
    assert low_load_warning(0.3) is None and low_load_warning(0.9) is None
