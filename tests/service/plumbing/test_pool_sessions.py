"""A pooled connection comes back clean without asyncpg's reset query (shared/db.py keep_session): a transaction
left open is rolled back, and migrations leave no advisory lock on the connection they ran on."""

from __future__ import annotations

from pathlib import Path

from shared.db import apply_migrations, create_pool


async def test_a_transaction_left_open_is_rolled_back_when_its_connection_goes_back(database_url: str) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            first = conn.get_server_pid()
            await conn.execute("BEGIN")
            await conn.execute("CREATE TEMP TABLE pool_sessions_left_open (x int)")
        async with pool.acquire() as conn:
            assert conn.get_server_pid() == first  # the same session, handed on
            assert not conn.is_in_transaction()
            # rolled back, not committed: the temp table of the open transaction is gone
            assert await conn.fetchval("SELECT to_regclass('pool_sessions_left_open')") is None
    finally:
        await pool.close()


async def test_migrations_leave_no_advisory_lock_on_a_pooled_connection(database_url: str, tmp_path: Path) -> None:
    (tmp_path / "001_first.sql").write_text("CREATE TABLE pool_sessions_mig.t (x int);")
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        await pool.execute("DROP SCHEMA IF EXISTS pool_sessions_mig CASCADE")  # this test's own, from an earlier run
        assert await apply_migrations(pool, "pool_sessions_mig", tmp_path) == ["001_first.sql"]
        async with pool.acquire() as conn:
            held = await conn.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
                                       conn.get_server_pid())
        assert held == 0
        await pool.execute("DROP SCHEMA pool_sessions_mig CASCADE")
    finally:
        await pool.close()
