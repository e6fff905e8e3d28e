"""Every `type: ignore` names the error it silences and says why (mypy runs in `make test`; an ignore without a
reason hides the next real error on that line)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("shared", "services", "sim", "cli", "gpuq_tools")
IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


def ignores_without_reason(text: str) -> list[int]:
    bad = []
    for number, line in enumerate(text.splitlines(), start=1):
        m = IGNORE.search(line)
        if m is None:
            continue
        reason = m.group("rest").strip().lstrip("#").strip()
        if not m.group("codes") or not reason:
            bad.append(number)
    return bad


def test_the_rule_catches_a_bare_ignore_and_accepts_a_reasoned_one() -> None:
    assert ignores_without_reason("x = f()  # type: ignore\n") == [1]
    assert ignores_without_reason("x = f()  # type: ignore[attr-defined]\n") == [1]
    assert ignores_without_reason("x = f()  # type: ignore[attr-defined]  # the library ships no types\n") == []


def test_every_type_ignore_names_its_code_and_its_reason() -> None:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    problems = [f"{path.relative_to(ROOT)}:{n}" for path in files for n in ignores_without_reason(path.read_text())]
    assert not problems, "type: ignore[code]  # why  -- missing on:\n" + "\n".join(problems)
