"""A second `gpuq up` on the same state directory is a standby: it says so, stops promptly on SIGTERM, and leaves the
active instance's servers file alone (the file the CLI finds the servers by)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from shared.servers import free_port


class Up:
    """One `gpuq up --services scheduler` process, its output collected line by line."""

    def __init__(self, home: Path, queues: Path, env: dict[str, str], cwd: Path):
        self.port = free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "gpuq"), "up", "--services", "scheduler", "--queues", str(queues),
             "--health-port", str(self.port), "--health-addr", "127.0.0.1", "--log-level", "WARNING"],
            cwd=cwd, env={**env, "GPUQ_HOME": str(home), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while what not in self.output():
            assert self.proc.poll() is None, self.output()
            if time.monotonic() > deadline:
                raise AssertionError(f"gpuq up did not print {what!r}: {self.output()}")
            time.sleep(0.1)

    def phase(self) -> str | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=5)
        except httpx.TransportError:
            return None
        body: dict[str, Any] = response.json()
        return str(body["services"]["scheduler"]["phase"])


def recorded_pid(home: Path) -> int | None:
    path = home / "servers.json"
    return int(json.loads(path.read_text())["pid"]) if path.exists() else None


def test_a_standby_says_so_stops_on_sigterm_and_leaves_the_servers_file(fresh_sync: tuple[str, str],
                                                                         tmp_path: Path) -> None:
    nats_url, database_url = fresh_sync
    queues = tmp_path / "queues.yaml"
    queues.write_text("priority_classes: [{name: normal, value: 100, preemptible: true}]\n"
                      "queues: [{name: team-a, teams: [team-a], quotas: {H100-80GB: {nominal: 8}}}]\n")
    home = tmp_path / "home"
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url}
    procs: list[Up] = []
    try:
        first = Up(home, queues, env, tmp_path)
        procs.append(first)
        first.wait_for("gpuq up: scheduler in namespace")
        assert recorded_pid(home) == first.proc.pid

        second = Up(home, queues, env, tmp_path)
        procs.append(second)
        second.wait_for("STANDBY")  # it says what it is doing instead of printing nothing
        assert second.phase() == "standby"
        assert recorded_pid(home) == first.proc.pid  # the active instance's file is untouched

        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(timeout=30) == 0, second.output()
        assert recorded_pid(home) == first.proc.pid  # and still there after the standby's exit
        assert first.phase() == "running"

        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=30) == 0, first.output()
        assert recorded_pid(home) is None  # the owner removes its own file
    finally:
        for up in procs:
            if up.proc.poll() is None:
                up.proc.kill()
                up.proc.wait()
