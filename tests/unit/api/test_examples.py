"""The producer SDK's examples (examples/): valid Python that uses gpuq only through the SDK. Airflow and kfp are not
installed here, so the pipeline examples are parsed, not imported; the plain script runs against a platform in
tests/service/security/test_sdk.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FRAMEWORKS = {"plain_script.py": set(), "airflow_task.py": {"airflow"}, "kubeflow_step.py": {"kfp"}}


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_an_example_uses_gpuq_only_through_the_sdk(name: str) -> None:
    tree = ast.parse((EXAMPLES / name).read_text(), filename=name)
    compile(tree, name, "exec")
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    outside = imported - set(sys.stdlib_module_names) - {"__future__", "gpuq_sdk"} - FRAMEWORKS[name]
    assert not outside, f"{name} imports {sorted(outside)}: an example needs only the SDK and its framework"
    assert "gpuq_sdk" in imported
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"submit", "wait"} <= called, f"{name} neither submits nor waits"


def test_every_example_is_checked() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(FRAMEWORKS)
