"""Postgres plumbing: an asyncpg pool and a minimal versioned-migration runner.

Why a minimal runner instead of Alembic/yoyo: each service owns one schema and a short list of plain SQL
files; the runner applies `NNN_name.sql` in order inside a transaction, records each in
`<schema>.schema_migrations`, and takes an advisory lock so two replicas starting together do not race.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

MIGRATION_RE = re.compile(r"^(\d{3,})_[a-z0-9_]+\.sql$")
SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


class MigrationError(RuntimeError):
    pass


# Statements that leave state in a Postgres session (it would outlive the unit of work and reach the next user of a
# pooled connection). tests/unit/contracts/test_pooled_sessions.py keeps them out of pooled code.
SESSION_STATE_RE = re.compile(
    r"pg_(?:try_)?advisory_lock(?:_shared)?\s*\(|(?-i:\b(?:UN)?LISTEN\s+[a-z_*\"])"
    r"|\bDECLARE\s+\w+\s+[A-Z ]*CURSOR\s+WITH\s+HOLD|\bPREPARE\s+\w+\s+AS\b|\bset_config\s*\([^)]*,\s*false\s*\)"
    r"|\bSET\s+(?:SESSION\s+)?(?:search_path|statement_timeout|lock_timeout|idle_in_transaction_session_timeout|role"
    r"|session_authorization|time\s*zone|timezone|application_name|work_mem|synchronous_commit"
    r"|default_transaction_\w+|jit)\b", re.I)


async def keep_session(conn: asyncpg.Connection) -> None:
    """What a pooled connection is reset with when it goes back to the pool: nothing beyond what asyncpg always
    does first (roll back a transaction left open, drop listeners).

    asyncpg's default reset query (unlock every advisory lock, close every cursor, stop listening, reset every
    setting) runs on every release: one more round trip to Postgres, and four statements for it to run, after every
    unit of work (each consumed batch, each relay pass). gpuq's pooled connections keep no session state to undo:
    locks are transaction-level (`pg_advisory_xact_lock`), settings are `SET LOCAL`, nothing listens; the one
    session lock (migrations, apply_migrations) is released before its connection goes back, or the connection is
    closed. tests/unit/contracts/test_pooled_sessions.py checks the code for statements that would leave state
    behind."""
    del conn


async def create_pool(url: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    try:
        pool = await asyncpg.create_pool(url, min_size=min_size, max_size=max_size, command_timeout=60,
                                         reset=keep_session)
    except (OSError, asyncpg.PostgresError) as exc:
        raise ConnectionError(f"cannot connect to Postgres at {redact(url)}: {exc}") from exc
    assert pool is not None
    return pool


def redact(url: str) -> str:
    return re.sub(r"://([^:/@]+):[^@]+@", r"://\1:***@", url)


def migration_files(directory: Path) -> list[tuple[int, Path]]:
    files: list[tuple[int, Path]] = []
    for path in sorted(directory.glob("*.sql")):
        m = MIGRATION_RE.match(path.name)
        if not m:
            raise MigrationError(f"{path}: migration files must be named NNN_name.sql")
        files.append((int(m.group(1)), path))
    versions = [v for v, _ in files]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"{directory}: two migrations share a version number")
    return files


def migration_lock_key(schema: str) -> int:
    """The advisory lock under which `schema`'s migrations are applied (one replica at a time)."""
    return int.from_bytes(hashlib.sha256(f"gpuq-migrate-{schema}".encode()).digest()[:8], "big", signed=True)


async def apply_migrations(pool: asyncpg.Pool, schema: str, directory: Path) -> list[str]:
    """Apply pending migrations of `schema`; returns the names applied now. Safe to call concurrently."""
    if not SCHEMA_RE.match(schema):
        raise MigrationError(f"invalid schema name {schema!r}")
    files = migration_files(directory)
    applied_now: list[str] = []
    lock_key = migration_lock_key(schema)
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
        try:
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            await conn.execute(
                f"""CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
                        version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {r["version"]: r["checksum"] for r in
                    await conn.fetch(f"SELECT version, checksum FROM {schema}.schema_migrations")}
            for version, path in files:
                sql = path.read_text()
                checksum = hashlib.sha256(sql.encode()).hexdigest()
                if version in done:
                    if done[version] != checksum:
                        raise MigrationError(f"{path.name} was changed after it was applied to schema {schema}; "
                                             "add a new migration instead")
                    continue
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute(
                        f"INSERT INTO {schema}.schema_migrations(version, name, checksum) VALUES ($1, $2, $3)",
                        version, path.name, checksum)
                applied_now.append(path.name)
        finally:
            try:
                await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
            except BaseException:
                # The session lock must not go back to the pool with the connection (its reset keeps sessions,
                # keep_session): closing the connection ends the session, and the lock with it.
                conn.terminate()
                raise
    return applied_now


async def dedicated_database(database_url: str, name: str) -> str:
    """The URL of database `name` on the same server, created if needed (benchmarks and test areas that want
    a database of their own); the given URL when the role may not create databases."""
    if not SCHEMA_RE.match(name):
        raise ValueError(f"invalid database name {name!r}")
    conn = await asyncpg.connect(database_url)
    try:
        if not await conn.fetchval("SELECT true FROM pg_database WHERE datname = $1", name):
            try:
                await conn.execute(f"CREATE DATABASE {name}")
            except asyncpg.InsufficientPrivilegeError:
                return database_url
            except asyncpg.DuplicateDatabaseError:
                pass
    finally:
        await conn.close()
    return with_database(database_url, name)


def with_database(database_url: str, name: str) -> str:
    """The same server's URL for database `name`."""
    parts = urlsplit(database_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


async def scratch_database(database_url: str, prefix: str) -> tuple[str, str]:
    """A new, empty database `<prefix>_<random>` on the same server, for benchmarks, demos and test sessions:
    (its URL, its name). It never reuses or drops an existing database, so it cannot destroy someone's data;
    whoever asked for it drops it with `drop_database` when done."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    if not SCHEMA_RE.match(name):
        raise ValueError(f"invalid database name {name!r}")
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    return with_database(database_url, name), name


async def drop_database(database_url: str, name: str) -> None:
    """Drop database `name` on the same server, if it exists (only ever one this process created)."""
    if not SCHEMA_RE.match(name):
        raise ValueError(f"invalid database name {name!r}")
    admin = await asyncpg.connect(database_url)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        await admin.close()
