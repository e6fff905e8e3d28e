"""`gpuq up` listens on this machine only unless told otherwise (--bind / GPUQ_BIND): the API, telemetry's
/metrics and the health endpoints are not open to the network by default; the image and the chart set 0.0.0.0
(issue 43)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from shared.servers import free_ports


def listening(env: dict[str, str], args: list[str], tmp_path: Path, ports: list[int]) -> tuple[dict[int, str], str]:
    """Start `gpuq up --services telemetry,api`, wait until it listens on all `ports`, and say where (port ->
    address); then stop it. Returns that and what it printed."""
    queues = tmp_path / "queues.yaml"
    queues.write_text("priority_classes: [{name: normal, value: 100, preemptible: true}]\n"
                      "queues: [{name: team-a, teams: [team-a], quotas: {H100-80GB: {nominal: 8}}}]\n")
    metrics, api, health = ports
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "gpuq"), "up", "--services", "telemetry,api", "--queues", str(queues),
         "--metrics-port", str(metrics), "--api-port", str(api), "--health-port", str(health),
         "--log-level", "WARNING", *args],
        cwd=tmp_path, env={**env, "GPUQ_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, "".join(lines)
            found = {c.laddr.port: c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
            if len(found) == len(ports):
                return found, "".join(lines)
            assert time.monotonic() < deadline, f"gpuq up listens on {found} only: {''.join(lines)}"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_up_listens_on_loopback_by_default_and_where_bind_says(fresh_sync: tuple[str, str], tmp_path: Path) -> None:
    nats_url, database_url = fresh_sync
    env = {k: v for k, v in os.environ.items() if k not in ("GPUQ_BIND", "GPUQ_HEALTH_ADDR")}
    env.update(NATS_URL=nats_url, DATABASE_URL=database_url)
    ports = free_ports(3)
    found, _ = listening(env, [], tmp_path, ports)
    assert found == dict.fromkeys(ports, "127.0.0.1")

    ports = free_ports(3)
    found, output = listening({**env, "GPUQ_BIND": "0.0.0.0"}, [], tmp_path, ports)
    assert found == dict.fromkeys(ports, "0.0.0.0")
    assert "listen on 0.0.0.0, reachable from other machines" in output


def test_a_bind_address_that_is_not_an_ip_is_named(tmp_path: Path) -> None:
    result = subprocess.run([str(Path(sys.executable).parent / "gpuq"), "up", "--bind", "everywhere"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2
    assert "--bind must be an IP address" in result.stdout and "'everywhere'" in result.stdout
