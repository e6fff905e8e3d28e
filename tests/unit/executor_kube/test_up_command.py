"""`gpuq up` says on its first line which executor runs: the simulated one by default, Kubernetes on request; a
kubeconfig that cannot be used is a clear error before any server starts."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def test_plain_up_says_it_is_simulated_on_its_first_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["up", "--queues", str(tmp_path / "missing.yaml"), "--data-dir", str(tmp_path)])
    first = result.output.splitlines()[0]
    assert "SIMULATED executor" in first and "--executor kube" in first
    assert result.exit_code == 2  # then the missing queues.yaml is named


def test_kube_up_names_an_unusable_kubeconfig(tmp_path: Path) -> None:
    result = runner.invoke(app, ["up", "--executor", "kube", "--kubeconfig", str(tmp_path / "nope.yaml"),
                                 "--data-dir", str(tmp_path)])
    lines = result.output.splitlines()
    assert lines[0].startswith("gpuq up: Kubernetes executor, kubeconfig")
    assert "cannot use" in result.output and "nope.yaml" in result.output and result.exit_code == 2
