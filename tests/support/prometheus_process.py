"""A real Prometheus for tests: Debian's `prometheus` binary with a temporary config and data directory on a free
port. Tests fail (never skip) when the binary is missing."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_prometheus(workdir: Path, config: dict[str, Any]) -> Iterator[str]:
    """Start Prometheus with `config` (written as JSON, which is YAML); yields its base URL once ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the `prometheus` binary is missing: install Debian's prometheus package "
                    "(apt-get install -y prometheus); this test never skips")
    port = free_port()
    config_file = workdir / "prometheus.yml"
    config_file.write_text(json.dumps(config))
    log_file = workdir / "prometheus.log"
    log = log_file.open("w")
    proc = subprocess.Popen([binary, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {log_file.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus did not become ready in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def query(url: str, expr: str) -> dict[str, Any]:
    """An instant query; fails the test on any error. Returns `data`."""
    resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body.get("status") == "success", f"{expr}\n→ {body}"
    data: dict[str, Any] = body["data"]
    return data
