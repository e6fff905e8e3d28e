"""The Helm chart rendered offline with the real tools (helm, kubernetes-validate, the prometheus-operator schemas,
hadolint), fetched once into .tools/ by deploy/tools/fetch-chart-tools.sh; a missing prerequisite fails with the
script's message saying what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuq"
TOOLS = Path(os.environ.get("GPUQ_TOOLS_DIR", ROOT / ".tools"))
RELEASE = "gpuq"
NAMESPACE = "gpuq-system"

Doc = dict[str, Any]


@dataclass(frozen=True)
class ChartTools:
    helm: Path
    crd_schemas: Path
    hadolint: Path
    kubernetes_validate: Path


@pytest.fixture(scope="session")
def tools() -> ChartTools:
    venv_bin = Path(sys.executable).parent
    res = subprocess.run([str(ROOT / "deploy" / "tools" / "fetch-chart-tools.sh")], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "GPUQ_TOOLS_DIR": str(TOOLS), "GPUQ_VENV_BIN": str(venv_bin)})
    assert res.returncode == 0, f"the chart tools are not available:\n{res.stderr}"
    return ChartTools(helm=TOOLS / "bin" / "helm", crd_schemas=TOOLS / "crd-schemas",
                      hadolint=venv_bin / "hadolint", kubernetes_validate=venv_bin / "kubernetes-validate")


@pytest.fixture(scope="session")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart with its optional subcharts switched off, as an install without `helm dependency build` is: helm
    refuses a chart whose declared dependencies are missing from charts/ whatever their conditions, so this copy
    drops the `dependencies` block (test_chart.py checks that block on the real Chart.yaml). The copy follows the
    links to deploy/prometheus/rules and deploy/grafana/dashboards, as `helm package` does."""
    copy = tmp_path_factory.mktemp("chart") / "gpuq"
    shutil.copytree(CHART, copy, symlinks=False)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    meta.pop("dependencies", None)
    (copy / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return copy


Helm = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def helm(tools: ChartTools) -> Helm:
    """Runs helm; its stderr comes back without the notes about following the chart's links."""
    def _helm(*args: str) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([str(tools.helm), *args], capture_output=True, text=True, timeout=120)
        res.stderr = "\n".join(line for line in res.stderr.splitlines() if "symbolic link" not in line)
        return res

    return _helm


Render = Callable[..., list[Doc]]


@pytest.fixture(scope="session")
def render(helm: Helm, chart: Path) -> Render:
    """Renders the chart (`helm template`) and returns its documents; a failure fails the test with helm's error."""
    def _render(*values: Path, sets: Sequence[str] = (), kube_version: str = "1.35.0") -> list[Doc]:
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube_version]
        for path in values:
            args += ["-f", str(path)]
        for item in sets:
            args += ["--set", item]
        res = helm(*args)
        assert res.returncode == 0, res.stderr
        return [doc for doc in yaml.safe_load_all(res.stdout) if doc]

    return _render
