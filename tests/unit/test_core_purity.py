"""The core/shell boundary: pure cores import no I/O library and read no clock (architecture guide, section 1)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_MODULES = {"asyncio", "faststream", "nats", "asyncpg", "kubernetes", "opentelemetry", "httpx",
                     "socket", "subprocess", "requests", "time", "random", "os"}
# The shell's own modules: a core that imports them reaches I/O indirectly.
FORBIDDEN_PROJECT_MODULES = ("shared.db", "shared.service", "shared.bus", "shared.servers", "shared.clock",
                             "shared.leader", "shared.tracing")
SHELL_SUFFIXES = (".app", ".store", ".handlers", ".batch", ".cli", ".bench", ".report")
FORBIDDEN_CALLS = {("datetime", "now"), ("datetime", "utcnow"), ("date", "today"), ("time", "time")}


def core_files() -> list[Path]:
    return sorted(p for p in (ROOT / "services").glob("*/core/**/*.py"))


def test_cores_exist() -> None:
    assert core_files(), "no pure core found under services/*/core"


def test_cores_import_no_io_and_read_no_clock() -> None:
    problems: list[str] = []
    for path in core_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            for name in names:
                shell = name.startswith("services.") and name.endswith(SHELL_SUFFIXES)
                if name.split(".")[0] in FORBIDDEN_MODULES or name.startswith(FORBIDDEN_PROJECT_MODULES) or shell:
                    problems.append(f"{rel}:{node.lineno} imports {name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in FORBIDDEN_CALLS:
                    problems.append(f"{rel}:{node.lineno} calls {owner.id}.{node.func.attr}()")
    assert not problems, "pure cores must take `now` and do no I/O:\n" + "\n".join(problems)
