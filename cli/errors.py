"""How the CLI words a failure in one line (cli/lazy.py prints it as `error: ...`)."""

from __future__ import annotations

from typing import Any


def validation_message(exc: Any) -> str:
    """A pydantic ValidationError as `field: what is wrong; other.field: ...` (no input dumps, no URLs)."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ())) or exc.title
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return f"invalid {exc.title}: " + "; ".join(parts)


def describe(exc: BaseException) -> str:
    """An unexpected exception as one line: its message (each pydantic field's), else its type."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return validation_message(exc)
    text = " ".join(str(exc).split())
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in ("ConnectionRefusedError",):
        return f"cannot connect: {text or type(exc).__name__}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
