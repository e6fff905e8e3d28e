"""docs/install.md's SQL for a Postgres the site already runs (section 2, "A Postgres you already run"): the role it
creates, owning the database it creates and nothing more (no superuser, no extension), can apply every service's
migrations, so that gpuq starts on it; and the database refuses other roles' connections. The statements are read from
the page itself, so the page and this test cannot drift apart."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from shared.db import apply_migrations, create_pool

ROOT = Path(__file__).resolve().parents[3]
MIGRATIONS = sorted(ROOT.glob("services/*/migrations"))


def documented_sql() -> list[str]:
    """The statements of the install guide's one ```sql block."""
    (block,) = re.findall(r"```sql\n(.*?)```", (ROOT / "docs" / "install.md").read_text(), re.DOTALL)
    text = "\n".join(line.split("--", 1)[0] for line in block.splitlines())
    return [stmt.strip() for stmt in text.split(";") if stmt.strip()]


def with_user(url: str, user: str, password: str, database: str) -> str:
    # The same server as `url`: its host and port, or (the embedded Postgres) its socket directory in the query.
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, f"{user}:{password}@{parts.hostname or ''}{port}", f"/{database}", parts.query,
                       ""))


async def test_the_documented_role_and_database_take_every_services_migrations(database_url: str) -> None:
    suffix = secrets.token_hex(4)
    role, database, password = f"gpuq_doc_{suffix}", f"gpuq_doc_{suffix}", f"pw-{suffix}"
    statements = documented_sql()
    assert [s.split()[:2] for s in statements] == [["CREATE", "ROLE"], ["CREATE", "DATABASE"], ["REVOKE", "ALL"]]
    # The page's names and password, made unique to this run.
    run = [re.sub(r"\bgpuq\b", role, s).replace("change-me", password) for s in statements]
    admin = await asyncpg.connect(database_url)
    try:
        for stmt in run:
            await admin.execute(stmt)
        url = with_user(database_url, role, password, database)
        pool = await create_pool(url, min_size=1, max_size=2)
        try:
            applied = {d.parent.name: await apply_migrations(pool, d.parent.name, d) for d in MIGRATIONS}
        finally:
            await pool.close()
        assert len(applied) == 8 and all(applied.values()), applied
        conn = await asyncpg.connect(url)
        try:
            assert not await conn.fetchval("SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
                                           "WHERE rolname = current_user")
            owners = await conn.fetch("SELECT nspname, pg_get_userbyid(nspowner) AS owner FROM pg_namespace "
                                      "WHERE nspname = ANY($1::text[])", list(applied))
            assert {r["nspname"]: r["owner"] for r in owners} == dict.fromkeys(applied, role)
        finally:
            await conn.close()
        # REVOKE ... FROM PUBLIC: a role that is neither the owner nor a superuser cannot connect.
        other = f"gpuq_other_{suffix}"
        await admin.execute(f"CREATE ROLE {other} LOGIN PASSWORD '{password}'")
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await asyncpg.connect(with_user(database_url, other, password, database))
        finally:
            await admin.execute(f"DROP ROLE {other}")
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()
