"""The core/shell boundary: metering's core imports nothing that does I/O, reads clocks or runs asyncio."""

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[3] / "services" / "metering" / "core"
FORBIDDEN = {"asyncio", "asyncpg", "faststream", "nats", "kubernetes", "opentelemetry", "httpx", "time", "socket",
             "subprocess", "random", "os", "services.metering.store", "services.metering.handlers", "shared.db",
             "shared.service", "shared.bus", "shared.servers", "shared.clock"}


def test_core_imports_are_pure():
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
                assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), f"{path.name}: {name}"
            if isinstance(node, ast.Attribute) and node.attr in {"now", "utcnow", "today"}:
                raise AssertionError(f"{path.name}: reads the clock ({node.attr})")
