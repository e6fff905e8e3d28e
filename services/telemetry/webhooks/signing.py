"""Standard Webhooks signatures (https://www.standardwebhooks.com/): `webhook-id`, `webhook-timestamp`,
`webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` keyed by the base64 part of a
per-subscription `whsec_` secret. While a secret is being rotated, the header carries one signature per valid
secret, space-separated (newest first), so receivers still holding the old secret keep verifying: rotation
without downtime. Written out here (a dozen lines) so the tests can check it against the reference
`standardwebhooks` package rather than against itself."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"
CONTENT_TYPE = "application/cloudevents+json"


def new_secret(nbytes: int = 32) -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(nbytes)).decode()


def _key(secret: str) -> bytes:
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("webhook secrets start with 'whsec_'")
    key = base64.b64decode(secret[len(SECRET_PREFIX):] + "==")
    if not key:
        raise ValueError("empty webhook secret")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    to_sign = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), to_sign, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secret: str | Sequence[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers for one attempt; `secret` may be several (a rotation in progress)."""
    if not msg_id or msg_id.strip() != msg_id or " " in msg_id:
        # An empty or space-carrying id cannot be verified by receivers (it is part of the signed content).
        raise ValueError(f"webhook-id must be a non-empty token without spaces, got {msg_id!r}")
    keys = [secret] if isinstance(secret, str) else list(secret)
    if not keys:
        raise ValueError("no webhook secret to sign with")
    return {
        "content-type": CONTENT_TYPE,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(k, msg_id, timestamp, body) for k in keys),
    }
