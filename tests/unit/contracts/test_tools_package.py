"""The benchmarks and the chaos harness are the tools package (gpuq_tools), outside the product: the service image's
wheel holds none of it, the product imports and runs without it, and `gpuq bench ...` / `gpuq chaos` say what is
missing where it is absent. (The import-linter contract "The product ... never imports the tools package" says
statically that services, shared, sim and cli do not import it.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

ROOT = Path(__file__).resolve().parents[3]
TOOLS = "gpuq_tools"

SITECUSTOMIZE = f'''
import sys


class _NotInstalled:
    """Refuses the tools package as an installation without it would."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {TOOLS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


def packages_in_wheel(tree: Path) -> list[str]:
    """The packages setuptools puts in the wheel built from `tree`, as pyproject.toml's packages.find says."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return sorted(find_namespace_packages(where=str(tree), include=find["include"]))


def test_the_image_wheel_holds_the_product_and_no_tools(tmp_path: Path) -> None:
    # The build stage's tree: exactly what the Dockerfile copies before `pip wheel .`.
    copied = re.findall(r"^COPY (?!--from)(\S+)/ ", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)
    for folder in copied:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    in_image = packages_in_wheel(tmp_path)
    assert {"shared", "services", "cli"} <= set(in_image), in_image
    assert not [p for p in in_image if p.partition(".")[0] == TOOLS], in_image
    # ...while a wheel built from the whole checkout carries the tools (`pip install .`: `gpuq bench` works there).
    assert {TOOLS, f"{TOOLS}.bench", f"{TOOLS}.chaos"} <= set(packages_in_wheel(ROOT))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("without-tools")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL") and
           not k.startswith("GPUQ_")}
    return {**out, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "GPUQ_CONFIG": os.devnull,
            "COLUMNS": "200"}


def python(env: dict[str, str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_product_module_imports_without_the_tools(env: dict[str, str]) -> None:
    res = python(env, f"""
        import importlib, pkgutil

        try:
            import {TOOLS}
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("the blocker let the tools package through")
        import cli, services, shared
        count = 0
        for package in (services, shared, cli):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if info.name.rpartition(".")[2] != "__main__":  # (a program: `python -m` runs it)
                    importlib.import_module(info.name)
                    count += 1
        print(count)
    """)
    assert res.returncode == 0, res.stderr[-4000:]
    assert int(res.stdout) > 100


@pytest.mark.parametrize("args", [["bench", "placement", "--help"], ["chaos", "--help"]])
def test_a_tools_command_works_with_the_tools_and_says_what_is_missing_without(env: dict[str, str],
                                                                              args: list[str]) -> None:
    gpuq = "from cli.main import app; app(prog_name='gpuq')"
    present = subprocess.run([sys.executable, "-c", gpuq, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**env, "PYTHONPATH": str(ROOT)})
    assert present.returncode == 0, present.stderr[-4000:]
    assert f"Usage: gpuq {' '.join(args[:-1])} [OPTIONS]" in present.stdout

    absent = python(env, gpuq, *args)
    assert absent.returncode == 1
    assert absent.stderr.splitlines() == [
        f"error: `gpuq {' '.join(args[:-1])}` is not installed here (no module '{TOOLS}'). The benchmarks and "
        f"`gpuq chaos` are the {TOOLS} package, which the service image leaves out: run them where gpuq is "
        "installed from its source (`pip install .`)."], absent.stderr
