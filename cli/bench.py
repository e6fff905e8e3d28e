"""`gpuq bench cli`: how long gpuq commands take from start to exit, each run as a user runs it (a new process).

Prints the median and the spread of N runs of `gpuq --help`, `gpuq status --help` and `gpuq submit --help` (start-up
and help alone), and with --api-url and --token of a running platform `gpuq status` through the API (start-up, one
HTTP call and the table). Figures only: wall time, and the CPU time the process used (user + system), which a loaded
machine inflates less; the median of each."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

import typer


def _gpuq() -> list[str]:
    """The installed `gpuq` beside this interpreter, else this interpreter running the same app."""
    script = shutil.which("gpuq", path=os.path.dirname(sys.executable)) or shutil.which("gpuq")
    return [script] if script else [sys.executable, "-c", "from cli.main import app; app(prog_name='gpuq')"]


def _time(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise typer.BadParameter(f"`{' '.join(argv[-2:])}` exited {done.returncode}: "
                                 f"{done.stderr.decode(errors='replace').strip()[-300:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_cli(
    runs: int = typer.Option(5, min=1, max=100, help="Runs of each command (the median is printed)"),
    api_url: str | None = typer.Option(None, "--api-url", help="A running gpuq API: also time `gpuq status` "
                                                               "through it"),
    token: str | None = typer.Option(None, "--token", help="A token for --api-url (`gpuq tokens create`)"),
) -> None:
    """Start-up time of gpuq commands: the median of --runs runs of each, each in a new process."""
    if api_url and not token:
        raise typer.BadParameter("--api-url needs --token", param_hint="--token")
    base = _gpuq()
    # No API or config file of the caller's: the help commands must not depend on them.
    env = {k: v for k, v in os.environ.items() if k not in ("GPUQ_API_URL", "GPUQ_TOKEN")}
    env["GPUQ_CONFIG"] = os.devnull
    cases: list[tuple[str, list[str], dict[str, str]]] = [
        ("gpuq --help", ["--help"], env), ("gpuq status --help", ["status", "--help"], env),
        ("gpuq submit --help", ["submit", "--help"], env)]
    if api_url and token:
        cases.append(("gpuq status (API)", ["status"], {**env, "GPUQ_API_URL": api_url, "GPUQ_TOKEN": token}))
    width = max(len(name) for name, _, _ in cases)
    typer.echo(f"{'command':<{width}}  wall s (median  min  max)  CPU s (median)  ({runs} runs each)")
    for name, args, case_env in cases:
        _time([*base, *args], case_env)  # warm the file cache: the first run after an install is not typical
        runs_ = [_time([*base, *args], case_env) for _ in range(runs)]
        wall = [w for w, _ in runs_]
        cpu = statistics.median(c for _, c in runs_)
        typer.echo(f"{name:<{width}}  {statistics.median(wall):13.3f} {min(wall):5.3f} {max(wall):5.3f}  {cpu:14.3f}")
