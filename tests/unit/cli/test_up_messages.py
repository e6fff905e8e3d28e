"""`gpuq up`'s words (issue 51): a busy port is one line naming it and the option that moves it; STANDBY only when
another instance holds a lease; the ready banner says where the API is and how to get a token."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from cli import platform

GPUQ = str(Path(sys.executable).parent / "gpuq")


def test_a_busy_port_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUQ_")}
        res = subprocess.run([GPUQ, "up", "--api-port", str(port), "--health-port", "0", "--services", "api"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**env, "GPUQ_CONFIG": str(tmp_path / "config.yaml"), "COLUMNS": "200",
                                  "GPUQ_HOME": str(tmp_path / "home")})
    assert res.returncode == 2, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert f"port {port} on 127.0.0.1 (the API) is already in use" in lines[0] and "--api-port" in lines[0]
    assert not (tmp_path / "home").exists()  # nothing started, nothing recorded


async def test_standby_is_said_only_once_another_instance_holds_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(platform, "console", Console(file=out, width=200))
    runtime = SimpleNamespace(phase="standby", lease_refusals=0, spec=SimpleNamespace(name="scheduler"))
    stack = SimpleNamespace(starting=runtime, runtimes=[])
    announcing = asyncio.create_task(platform._announce_standby(stack))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0.6)  # three of the announcer's looks at the phase: the first attempt is under way
        assert out.getvalue() == ""
        runtime.lease_refusals = 1  # the attempt found another instance holding the lease
        for _ in range(100):
            if "STANDBY" in out.getvalue():
                break
            await asyncio.sleep(0.05)
        assert "STANDBY: another instance holds the scheduler lease" in out.getvalue()
    finally:
        announcing.cancel()


def test_the_ready_banner_says_where_the_api_is_and_how_to_get_a_token() -> None:
    lines = platform._ready_lines(["admission", "api"], "0.0.0.0", 8123, True)
    assert "API at http://127.0.0.1:8123" in lines[0] and "gpuq tokens create NAME --team TEAM" in lines[0]
    assert "GPUQ_API_URL=http://127.0.0.1:8123" in lines[0]
    assert any("from any directory" in line for line in lines)
    assert not any("API at" in line for line in platform._ready_lines(["admission"], "127.0.0.1", 8123, False))
