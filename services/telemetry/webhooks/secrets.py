"""Where webhook signing secrets cross into and out of storage: the one place to change to keep them encrypted at
rest. Every read and write of a secret column in `store.py` goes through `seal` / `unseal`; today they store the
`whsec_` string as it is."""

from __future__ import annotations


def seal(secret: str) -> str:
    """The form a secret is stored in."""
    return secret


def unseal(stored: str) -> str:
    """The secret a stored value holds."""
    return stored
