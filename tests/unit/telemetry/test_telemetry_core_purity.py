"""The core stays pure: no I/O frameworks, no asyncio, no clock reads."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[3] / "services" / "telemetry" / "core"
FORBIDDEN = {"asyncio", "faststream", "nats", "asyncpg", "kubernetes", "opentelemetry", "httpx", "time",
             "socket", "random", "prometheus_client", "os", "subprocess", "threading"}


def test_core_imports_nothing_impure() -> None:
    files = sorted(CORE.glob("*.py"))
    assert files
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) not in {("datetime", "now"), ("datetime", "utcnow")}, path.name
