"""Standard Webhooks signatures (https://www.standardwebhooks.com/): `webhook-id`, `webhook-timestamp`,
`webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` keyed by the base64 part of a
per-subscription `whsec_` secret. Written out here (a dozen lines) so the tests can check it against the
reference `standardwebhooks` package rather than against itself."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

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


def signed_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "content-type": CONTENT_TYPE,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }
