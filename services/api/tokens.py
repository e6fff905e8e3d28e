"""API bearer tokens: `gpuq_<id>.<secret>`, mapped to a team or to the platform-admin role.

Only the SHA-256 of the secret is stored. The secret is 32 random bytes, so a fast hash is enough (a slow password
hash protects guessable secrets; these are not guessable), and lookups by id keep verification to one row and a
constant-time comparison. Issued by `gpuq tokens create` (an admin with database access), shown once, revoked by
`gpuq tokens revoke`; rotation is a new token then revoking the old one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

import asyncpg

PREFIX = "gpuq_"
ADMIN_ROLE = "admin"
TEAM_ROLE = "team"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a team's member, or a platform admin (who sees and may do everything)."""

    name: str
    team: str | None
    admin: bool
    via: str = "token"  # "token": a gpuq API token; "kube": a Kubernetes token the API server vouched for

    @property
    def actor(self) -> str:
        """As the audit trail names it: token:<name> / admin:<name>, kube:<user> / admin:kube:<user>."""
        who = f"kube:{self.name}" if self.via == "kube" else self.name
        if self.admin:
            return f"admin:{who}"
        return who if self.via == "kube" else f"token:{who}"

    def may_see(self, team: str) -> bool:
        return self.admin or self.team == team


@dataclass(frozen=True)
class IssuedToken:
    id: str
    token: str  # shown once
    name: str
    team: str | None
    role: str


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


async def issue(conn: asyncpg.Connection, name: str, *, team: str | None, admin: bool = False,
                expires_at: datetime | None = None) -> IssuedToken:
    if admin == (team is not None):
        raise ValueError("a token is either a team's (--team) or an admin's (--admin), not both or neither")
    token_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    role = ADMIN_ROLE if admin else TEAM_ROLE
    await conn.execute(
        "INSERT INTO api.tokens(id, name, team, role, secret_hash, expires_at) VALUES ($1, $2, $3, $4, $5, $6)",
        token_id, name, team, role, _hash(secret), expires_at)
    return IssuedToken(token_id, f"{PREFIX}{token_id}.{secret}", name, team, role)


async def authenticate(conn: asyncpg.Connection, token: str, now: datetime) -> Principal | None:
    """The principal of a presented token; None for anything unknown, revoked, expired or malformed."""
    if not token.startswith(PREFIX) or "." not in token:
        return None
    token_id, _, secret = token.removeprefix(PREFIX).partition(".")
    row = await conn.fetchrow("SELECT name, team, role, secret_hash, expires_at, revoked_at FROM api.tokens "
                              "WHERE id = $1", token_id)
    if row is None or not hmac.compare_digest(bytes(row["secret_hash"]), _hash(secret)):
        return None
    if row["revoked_at"] is not None or (row["expires_at"] is not None and row["expires_at"] <= now):
        return None
    return Principal(name=row["name"], team=row["team"], admin=row["role"] == ADMIN_ROLE)


async def revoke(conn: asyncpg.Connection, token_id: str) -> bool:
    status = await conn.execute("UPDATE api.tokens SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
                                token_id.removeprefix(PREFIX).partition(".")[0])
    return status.endswith(" 1")


async def list_tokens(conn: asyncpg.Connection) -> list[dict[str, object]]:
    rows = await conn.fetch("SELECT id, name, team, role, created_at, expires_at, revoked_at FROM api.tokens "
                            "ORDER BY created_at, id")
    return [dict(r) for r in rows]
