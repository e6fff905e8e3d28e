"""Where webhook signing secrets cross into and out of storage: every read and write of a secret column in
`store.py` goes through `seal` / `unseal`, which keep them encrypted at rest (Fernet, `shared/secretbox.py`; the
key from `GPUQ_SECRETS_KEY` or a mounted Secret)."""

from __future__ import annotations

from shared.secretbox import decrypt, encrypt


def seal(secret: str) -> str:
    """The form a secret is stored in: encrypted with the newest key."""
    return encrypt(secret)


def unseal(stored: str) -> str:
    """The secret a stored value holds (plain-text rows of old are still read; `gpuq webhooks reencrypt`)."""
    return decrypt(stored)
