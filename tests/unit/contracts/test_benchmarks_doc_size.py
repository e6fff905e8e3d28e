"""docs/benchmarks.md is a reference, not a notebook (issue 50): current figures and the command that prints each,
at most 500 lines; the history of attempts stays in git, one line per attempt in a "What we tried" list."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "benchmarks.md"
MAX_LINES = 500


def test_the_benchmarks_doc_stays_a_reference() -> None:
    lines = DOC.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/benchmarks.md: {len(lines)} lines (at most {MAX_LINES}); history goes to git"
