"""Small rooms (issue 50): no class of the product over 400 lines and no function over 80, counted as the
reviewers count them (`ast`: end_lineno - lineno + 1, docstrings and comments included). A class or function that
grows past them is split by responsibility, not trimmed of its comments."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("services", "shared", "sim", "cli", "gpuq_sdk")
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def sizes(source: str, path: str) -> list[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every class and function in `source`."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = f"{prefix}{child.name}"
                found.append((kind, f"{path}:{name}", (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def oversized(found: list[tuple[str, str, int]]) -> list[str]:
    limit = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    return sorted(f"{name} ({kind}, {n} lines)" for kind, name, n in found if n > limit[kind])


def test_no_class_over_400_lines_and_no_function_over_80() -> None:
    found: list[tuple[str, str, int]] = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.extend(sizes(path.read_text(), str(path.relative_to(ROOT))))
    assert len(found) > 1000  # the walk saw the product
    assert oversized(found) == []


def test_the_count_sees_a_long_method_inside_a_class() -> None:
    long_method = "class A:\n    def f(self):\n" + "        x = 1\n" * 80
    assert oversized(sizes(long_method, "m.py")) == ["m.py:A.f (function, 81 lines)"]
    assert oversized(sizes("def g():\n" + "    pass\n" * 79, "m.py")) == []
