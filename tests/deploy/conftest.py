"""The Helm chart rendered offline with the real tools (helm, kubernetes-validate, the prometheus-operator schemas,
hadolint), fetched once into .tools/ by deploy/tools/fetch-chart-tools.sh; a missing prerequisite fails with the
script's message saying what to install. helm runs on the chart's own directory, with no network and no state of
its own, as on an air-gapped machine."""

from __future__ import annotations

import os
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
def chart() -> Path:
    """The chart's own directory, as an operator installs it: it declares no dependencies (NATS and Postgres come
    from their own charts, docs/install.md), so helm needs nothing fetched to lint, render or package it. helm
    follows its links to deploy/prometheus/rules and deploy/grafana/dashboards."""
    return CHART


Helm = Callable[..., subprocess.CompletedProcess[str]]


# Where nothing listens: a proxy that makes any download helm tried fail at once.
NO_NETWORK = "http://127.0.0.1:9"


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's environment on an air-gapped machine that never ran helm: empty config, cache and data (no chart
    repositories known, nothing cached) and every HTTP(S) request sent to a closed port."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and not k.startswith("HELM_")}
    return {**env, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"), "HTTP_PROXY": NO_NETWORK, "HTTPS_PROXY": NO_NETWORK,
            "http_proxy": NO_NETWORK, "https_proxy": NO_NETWORK, "NO_PROXY": "", "no_proxy": ""}


@pytest.fixture(scope="session")
def helm(tools: ChartTools, helm_env: dict[str, str]) -> Helm:
    """Runs helm offline (helm_env); its stderr comes back without the notes about following the chart's links."""
    def _helm(*args: str) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([str(tools.helm), *args], capture_output=True, text=True, timeout=120, env=helm_env)
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
