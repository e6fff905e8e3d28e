"""The core/shell boundary (architecture guide, section 1). What cores may import is an import-linter contract
(`[tool.importlinter]` in pyproject.toml, run by `make test`); what an import cannot show is checked here:
a core calls no clock (`datetime.now()` needs no extra import)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_CALLS = {("datetime", "now"), ("datetime", "utcnow"), ("date", "today"), ("time", "time")}


def core_files() -> list[Path]:
    # every core lives under services/core/ (one tree the shells import downward)
    return sorted((ROOT / "services" / "core").glob("**/*.py"))


def test_cores_exist() -> None:
    assert core_files(), "no pure core found under services/core"


def test_cores_read_no_clock() -> None:
    problems: list[str] = []
    for path in core_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in FORBIDDEN_CALLS:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {owner.id}.{node.func.attr}()")
    assert not problems, "pure cores must take `now`:\n" + "\n".join(problems)
