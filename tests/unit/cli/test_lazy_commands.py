"""`gpuq` imports a command's module only when that command runs or shows its help (cli/lazy.py), and a failure
reads as one line (`error: ...`) unless --debug."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
import typer.models

from cli.main import Benchmarks, Commands

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("asyncpg", "nats", "fastapi", "httpx", "services", "sim", "gpuq_tools", "shared.bus", "shared.events",
         "shared.domain")


def _gpuq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command in a new process, as a user runs it; it prints the heavy modules it imported at exit."""
    code = ("import atexit, sys\n"
            f"atexit.register(lambda: print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted({h.split('.')[0] for h in HEAVY})!r} and m.startswith({HEAVY!r})), file=sys.stderr))\n"
            "from cli.main import app\napp(prog_name='gpuq')\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**base, "GPUQ_CONFIG": os.devnull, "COLUMNS": "200", **(env or {})}, timeout=120)


def _loaded(stderr: str) -> list[str]:
    line = next(x for x in stderr.splitlines() if x.startswith("LOADED "))
    return list(eval(line.removeprefix("LOADED ")))  # a list literal this test printed


@pytest.mark.parametrize("args", [["--help"], ["status", "--help"], ["submit", "--help"], ["cancel", "--help"],
                                  ["bench", "--help"], ["up", "--help"], ["demo", "--help"], ["tokens", "--help"],
                                  ["audit", "--help"], ["nats-auth", "--help"]])
def test_help_imports_no_service_module(args: list[str]) -> None:
    res = _gpuq(*args)
    assert res.returncode == 0, res.stderr
    assert "Usage" in res.stdout
    assert _loaded(res.stderr) == [], res.stderr


def test_each_listed_command_loads_with_the_help_it_is_listed_with() -> None:
    for group in (Commands, Benchmarks):
        for name, lazy in group.LAZY.items():
            module, _, attribute = lazy.target.partition(":")
            target = getattr(__import__(module, fromlist=[attribute]), attribute)
            if isinstance(target, typer.Typer):
                text = target.info.help
            else:
                command = typer.main.get_command_from_info(typer.models.CommandInfo(name=name, callback=target),
                                                           pretty_exceptions_short=True, rich_markup_mode="rich")
                text = command.help
            assert isinstance(text, str), name
            assert " ".join(inspect.cleandoc(text).split()).startswith(lazy.summary.rstrip(".")), (name, text)


def test_a_command_shows_its_own_options() -> None:
    res = _gpuq("cancel", "--help")
    assert "--reason" in res.stdout and "--before-arrival" in res.stdout


def test_an_unknown_command_is_one_line_with_the_near_name() -> None:
    res = _gpuq("stauts")
    assert res.returncode == 2
    lines = [x for x in res.stderr.splitlines() if not x.startswith("LOADED ")]
    assert lines == ["error: No such command 'stauts'. Did you mean 'status'? (see `gpuq --help`)"]


def test_a_failure_is_one_line_and_debug_shows_the_traceback() -> None:
    closed = {"DATABASE_URL": "postgresql://postgres@127.0.0.1:9/nothing"}  # port 9 (discard): nothing listens
    res = _gpuq("status", env=closed)
    lines = [x for x in res.stderr.splitlines() if not x.startswith("LOADED ")]
    assert res.returncode == 1
    assert len(lines) == 1 and lines[0].startswith("error: cannot connect: ") and "--debug" in lines[0], lines
    for debug in (["--debug", "status"], ["status", "--debug"]):
        res = _gpuq(*debug, env=closed)
        assert res.returncode == 1 and "ConnectionRefusedError" in res.stderr
        assert len(res.stderr.splitlines()) > 5
    res = _gpuq("status", env={**closed, "GPUQ_DEBUG": "1"})
    assert res.returncode == 1 and len(res.stderr.splitlines()) > 5


def test_a_validation_error_names_each_field_in_one_line() -> None:
    from pydantic import BaseModel, Field, ValidationError

    from cli.errors import describe

    class Spec(BaseModel):
        gpus: int = Field(ge=1)
        name: str

    with pytest.raises(ValidationError) as caught:
        Spec.model_validate({"gpus": 0})
    assert describe(caught.value) == ("invalid Spec: gpus: Input should be greater than or equal to 1; "
                                      "name: Field required")


def test_up_offers_every_service_by_default() -> None:
    from cli import platform
    from services.stack import ALL_SERVICES

    assert platform.ALL_SERVICES == ALL_SERVICES


def test_bench_cli_prints_a_row_per_command() -> None:
    res = _gpuq("bench", "cli", "--runs", "1")
    assert res.returncode == 0, res.stderr
    rows = [line.split()[0:3] for line in res.stdout.splitlines()[1:]]
    assert [" ".join(r[:2]) for r in rows] == ["gpuq --help", "gpuq status", "gpuq submit"], res.stdout
    res = _gpuq("bench", "cli", "--api-url", "http://127.0.0.1:9")
    assert res.returncode == 2 and "error: Invalid value for --token: --api-url needs --token" in res.stderr
