"""The service image leaves out the simulator's extra (`gpuq[sim]`: numpy, matplotlib and what only they need):
with those made unimportable, every service and shared module imports, the stack builds every service (the
admission service's ETA included) without loading the simulator, and the CLI's operator paths work; only
`gpuq simulate` needs the extra, and it says how to install it.

Each check runs in a fresh interpreter whose `sitecustomize` (on PYTHONPATH) puts a finder first on
`sys.meta_path` that refuses those modules, as if they were not installed. (The import-linter contract "The
services and shared code never import the simulator or its plotting libraries" says the same statically.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# The sim extra and the packages only matplotlib brings (none of them is a service dependency: requirements.lock).
BLOCKED = ("numpy", "matplotlib", "mpl_toolkits", "contourpy", "kiwisolver", "cycler", "fontTools", "PIL", "pyparsing",
           "dateutil", "packaging", "tzdata")
INSTALL_HINT = "pip install 'gpuq[sim]'"

SITECUSTOMIZE = f'''
import sys

BLOCKED = {BLOCKED!r}


class _NotInstalled:
    """Refuses the simulator's extra as an interpreter without it would."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("without-sim-extra")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL")}
    out["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return out


def python(env: dict[str, str], code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def gpuq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The `gpuq` console script's entry point, with COLUMNS wide enough that no message is wrapped."""
    return subprocess.run([sys.executable, "-c", "from cli.main import app; app(prog_name='gpuq')", *args],
                          cwd=ROOT, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)


def test_the_blocker_makes_the_extra_unimportable(env: dict[str, str]) -> None:
    for name in ("numpy", "matplotlib.pyplot"):
        res = python(env, f"import {name}")
        assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, res.stderr


def test_every_service_module_imports_and_the_stack_builds_without_the_simulator(env: dict[str, str]) -> None:
    res = python(env, """
        import importlib, pkgutil, sys

        import services, shared
        names = []
        for package in (services, shared):
            for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
                if info.name.rpartition(".")[2] != "__main__":  # (a program: `python -m` runs it)
                    names.append(info.name)
                    importlib.import_module(info.name)

        from services.stack import ALL_SERVICES, StackSettings, build_specs
        from shared.config import parse_cluster, parse_queues

        queues = parse_queues({"priority_classes": [{"name": "normal", "value": 1}],
                               "queues": [{"name": "q", "quotas": {"H100": {"nominal": 8}}}]})
        cluster = parse_cluster({"node_groups": [{"name": "h", "count": 1, "gpus_per_node": 8, "gpu_model": "H100",
                                                  "cpu_milli": 1000, "memory_mib": 1000}]}, "test")
        specs = build_specs(StackSettings(nats_url="nats://x", database_url="postgresql://x", queues=queues,
                                          cluster=cluster, services=ALL_SERVICES, admission_cohorts=()))
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("sim", "numpy", "matplotlib"))
        assert not loaded, loaded
        print(len(names), "modules;", ",".join(sorted(s.name for s in specs)))
    """)
    assert res.returncode == 0, res.stderr[-4000:]
    count, _, built = res.stdout.strip().partition(" modules;")
    assert int(count) > 100
    assert set(built.strip().split(",")) >= {"admission", "scheduler", "preemption", "metering", "telemetry",
                                             "executor", "audit", "api"}


def test_the_cli_imports_and_its_operator_paths_work(env: dict[str, str]) -> None:
    res = python(env, """
        import importlib, pkgutil, sys

        import cli
        for info in pkgutil.walk_packages(cli.__path__, "cli."):
            if info.name.rpartition(".")[2] != "__main__":
                importlib.import_module(info.name)
        import cli.main
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("numpy", "matplotlib"))
        assert not loaded, loaded
    """)
    assert res.returncode == 0, res.stderr[-4000:]
    for args in (["--help"], ["up", "--help"], ["tokens", "--help"], ["nats-auth", "--help"],
                 ["simulate", "--help"]):
        res = gpuq(env, *args)
        assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-4000:])
        assert "Usage" in res.stdout


def test_simulate_without_the_extra_says_how_to_install_it(env: dict[str, str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,submit_time,duration,gpus,team\nj1,0,60,1,a\n")
    res = gpuq(env, "simulate", "--trace", str(trace))
    assert res.returncode == 2
    assert INSTALL_HINT in res.stdout + res.stderr and "numpy, matplotlib" in res.stdout + res.stderr
    # With the extra (the test's own environment), the same command gets past that check to the trace itself.
    res = gpuq({**env, "PYTHONPATH": str(ROOT)}, "simulate", "--trace", str(trace))
    assert INSTALL_HINT not in res.stdout + res.stderr
    assert "cluster" in res.stdout + res.stderr  # the generic CSV needs --cluster: the simulator's own error
