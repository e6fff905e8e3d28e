"""Secrets at rest (webhook signing secrets): encrypted with Fernet (`cryptography`), key from the environment or a
mounted Secret, never stored in plain text.

Keys: `GPUQ_SECRETS_KEY` (one or more Fernet keys, comma-separated: the first encrypts, all decrypt, so a key is
rotated by putting the new one first and re-encrypting), else the file named by `GPUQ_SECRETS_KEY_FILE` (a
Kubernetes Secret mounted as a file), else, for a laptop, `$GPUQ_HOME/secrets.key` (default `.gpuq/`), created 0600
on first use. Stored values look like `fernet:<token>`; a value without the prefix was written before encryption
and is read as is until `gpuq webhooks reencrypt` encrypts it (docs/security.md).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from shared.natsauth import write_private

log = logging.getLogger("gpuq.secrets")
KEY_ENV = "GPUQ_SECRETS_KEY"
KEY_FILE_ENV = "GPUQ_SECRETS_KEY_FILE"
PREFIX = "fernet:"


class SecretsKeyError(RuntimeError):
    pass


def _local_key_file() -> Path:
    from shared.settings import settings  # here, as in _key_text: `gpuq webhooks` starts without pydantic-settings

    return settings().home / "secrets.key"


def _key_text() -> str:
    from shared.settings import settings

    given = settings()
    if given.secrets_key:
        return given.secrets_key
    path = given.secrets_key_file or _local_key_file()
    if not path.exists():
        if given.secrets_key_file:
            raise SecretsKeyError(f"{KEY_FILE_ENV} names {path}, which does not exist")
        log.warning("no %s: generating a local secrets key in %s (set %s or %s for a platform that lives)",
                    KEY_ENV, path, KEY_ENV, KEY_FILE_ENV)
        write_private(path, Fernet.generate_key().decode())
    return path.read_text().strip()


@lru_cache(maxsize=4)
def _box(key_text: str) -> MultiFernet:
    try:
        return MultiFernet([Fernet(k.strip().encode()) for k in key_text.split(",") if k.strip()])
    except (ValueError, TypeError) as exc:
        raise SecretsKeyError(f"the secrets key is not a Fernet key (32 url-safe base64 bytes): {exc}") from None


def encrypt(plain: str) -> str:
    return PREFIX + _box(_key_text()).encrypt(plain.encode()).decode()


def decrypt(stored: str) -> str:
    if not stored.startswith(PREFIX):
        return stored  # written before secrets were encrypted
    try:
        return _box(_key_text()).decrypt(stored.removeprefix(PREFIX).encode()).decode()
    except InvalidToken:
        raise SecretsKeyError("a stored secret cannot be decrypted with the configured key(s): was the key "
                              f"rotated without keeping the old one in {KEY_ENV}?") from None


def reencrypt(stored: str) -> str:
    """With the first (newest) key; plain-text values get encrypted."""
    return encrypt(decrypt(stored))
