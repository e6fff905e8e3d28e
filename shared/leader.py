"""Single active instance per scope: a Postgres advisory lock held on a dedicated connection, plus a
monotonically increasing term used as a fencing token.

A lease may also be taken in shared mode: shared holders of a scope do not exclude each other, but they
exclude an exclusive holder of the same scope (and it them). Sharded services use this so that an instance
that serves everything and instances that serve parts never run at the same time (see docs/admission.md,
"Running several admission instances"). A shared lease has no term: several holders cannot share one fence.

Why Postgres and not a NATS KV lease: Postgres is already the source of truth, and checking the term in
the same transaction as a write makes a deposed leader's late write fail instead of landing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable

import asyncpg

from shared.settings import settings

log = logging.getLogger("gpuq.leader")


class LostLeadership(RuntimeError):
    pass




def lease_ttl_from_env() -> float:
    """GPUQ_LEASE_TTL_S: how long a leader may stop answering before its lease lapses (default 30 s)."""
    return settings().lease_ttl_s


def lock_key(scope: str) -> int:
    return int.from_bytes(hashlib.sha256(f"gpuq-leader-{scope}".encode()).digest()[:8], "big", signed=True)


class LeaderLease:
    def __init__(self, database_url: str, schema: str, scope: str, *, shared: bool = False,
                 ttl_s: float | None = None):
        self.database_url = database_url
        # A leader that stops answering (paused, its event loop stuck) loses the lock after `ttl_s`: the server
        # ends a lease session idle that long (idle_session_timeout, Postgres 14+), and the lock goes with it. The
        # holder's watcher queries it every few seconds, so a live leader is never idle that long.
        self.ttl_s = ttl_s if ttl_s is not None else lease_ttl_from_env()
        self.schema = schema
        self.scope = scope
        self.shared = shared
        self.term: int | None = None
        self._conn: asyncpg.Connection | None = None
        self._locked_on: asyncpg.Connection | None = None  # the session the advisory lock was taken on

    @property
    def held(self) -> bool:
        """Whether the lock is held, as far as its connection knows (no query: for health reports)."""
        conn = self._conn
        return conn is not None and not conn.is_closed() and conn is self._locked_on

    async def try_acquire(self) -> bool:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(
                self.database_url, timeout=10,
                server_settings={"idle_session_timeout": str(int(self.ttl_s * 1000))})
        mode = "_shared" if self.shared else ""
        got = await self._conn.fetchval(f"SELECT pg_try_advisory_lock{mode}($1)", lock_key(self.scope))
        if not got:
            return False
        self._locked_on = self._conn
        if self.shared:
            log.info("holding %s in shared mode", self.scope)
            return True
        async with self._conn.transaction():
            # Leaders of other scopes in this schema may be doing the same right now.
            await self._conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(f"terms-{self.schema}"))
            await self._conn.execute(
                f"CREATE TABLE IF NOT EXISTS {self.schema}.leader_terms(scope text PRIMARY KEY, term bigint NOT NULL)")
            self.term = await self._conn.fetchval(
                f"INSERT INTO {self.schema}.leader_terms(scope, term) VALUES ($1, 1) "
                "ON CONFLICT (scope) DO UPDATE SET term = leader_terms.term + 1 RETURNING term", self.scope)
        log.info("leader for %s with term %s", self.scope, self.term)
        return True

    async def acquire(self, poll_s: float = 1.0, *, on_attempt: Callable[[BaseException | None], None] | None = None,
                      max_backoff_s: float = 5.0) -> int:
        """Wait until this instance leads; returns the term (0 for a shared lease). A standby polls until the
        leader's lock goes. An unreachable Postgres (restarting, failing over) is retried with a growing delay,
        capped at `max_backoff_s`: the lease is taken again the moment the server answers and the lock is free.
        `on_attempt(error)` hears of every attempt that did not get the lock (None: the server answered, another
        instance holds it)."""
        delay = poll_s
        while True:
            try:
                if await self.try_acquire():
                    break
                error: BaseException | None = None
                delay = poll_s
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                error = exc
                self._drop_connection()
                log.warning("%s: cannot reach Postgres for the lease (%s: %s); retrying in %.1f s",
                            self.scope, type(exc).__name__, exc, delay)
            if on_attempt is not None:
                on_attempt(error)
            await asyncio.sleep(delay)
            if error is not None:
                delay = min(delay * 2, max_backoff_s)
        if self.shared:
            return 0
        assert self.term is not None
        return self.term

    def _drop_connection(self) -> None:
        """Forget a broken lease connection (its session, and any lock on it, is gone or going with it)."""
        conn, self._conn = self._conn, None
        self._locked_on = None
        if conn is not None and not conn.is_closed():
            conn.terminate()

    async def alive(self) -> bool:
        if self._conn is None or self._conn.is_closed():
            return False
        try:
            await self._conn.fetchval("SELECT 1", timeout=5)
        except Exception as exc:  # whatever the failure, a lease that cannot answer is not to be trusted
            log.warning("%s: the lease connection does not answer: %s: %s", self.scope, type(exc).__name__, exc)
            return False
        return True

    async def check_fence(self, conn: asyncpg.Connection) -> None:
        """Inside a write transaction: fail unless this instance's term is still the current one."""
        if self.shared:
            return  # no term to check: shared holders are not exclusive leaders
        current = await conn.fetchval(f"SELECT term FROM {self.schema}.leader_terms WHERE scope = $1", self.scope)
        if current != self.term:
            raise LostLeadership(f"{self.scope}: term {self.term} was superseded by {current}")

    async def release(self) -> None:
        """Give the lock back. The lease connection may still be busy with a cancelled liveness check (the
        watcher is cancelled on stop), and a graceful unlock/close on it can then wait forever while the
        session keeps the lock, so a standby never takes over: after a few seconds the connection is
        terminated instead, and the server drops the session's advisory locks with it."""
        conn, self._conn = self._conn, None
        self._locked_on = None
        if conn is None or conn.is_closed():
            return
        mode = "_shared" if self.shared else ""
        try:
            await asyncio.wait_for(conn.execute(f"SELECT pg_advisory_unlock{mode}($1)", lock_key(self.scope)),
                                   timeout=5)
            await asyncio.wait_for(conn.close(), timeout=5)
        except asyncio.CancelledError:
            conn.terminate()
            raise
        except Exception:
            log.warning("%s: lease connection did not close cleanly; terminating it", self.scope)
            conn.terminate()
