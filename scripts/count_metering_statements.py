"""Statements metering sends to Postgres for 1,000 jobs' placement and start facts, handled in batches of 32
messages per transaction, once as a batch with a savepoint per message and once as an optimistic batch (held
facts written at its end). Needs DATABASE_URL (a scratch database is made and dropped).

    DATABASE_URL=postgresql://... .venv/bin/python scripts/count_metering_statements.py
"""
import asyncio
import os
from typing import Any

from services.metering.handlers import HANDLERS
from services.metering.store import migrate
from services.metering.testing import at, event, placed, spec
from shared.events import JobStarted
from shared.service import Tx


class Counting:
    """A connection that counts the statements sent through it."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.n = conn, 0

    def __getattr__(self, name: str) -> Any:
        f = getattr(self.conn, name)
        if name in ("execute", "fetch", "fetchval", "fetchrow", "executemany"):
            async def wrapped(*a: Any, **k: Any) -> Any:
                self.n += 1
                return await f(*a, **k)
            return wrapped
        return f


async def main() -> None:
    from shared.db import create_pool, drop_database, scratch_database
    base = os.environ["DATABASE_URL"]
    url, name = await scratch_database(base, "gpuq_meter_count")
    pool = await create_pool(url, max_size=2)
    try:
        await migrate(pool)
        events = []
        for i in range(1000):
            s = spec(f"j{i:04d}", gpus=1, pods=1)
            events += [event(placed(s, 0, [f"n{i // 8:03d}"], gpus_per_node=1)),
                       event(JobStarted(job_id=s.job_id, started_at=at(1)), 1)]
        events = events[0::2] + events[1::2]
        for own_savepoint in (True, False):
            async with pool.acquire() as conn:
                await conn.execute("TRUNCATE metering.jobs, metering.job_facts, metering.allocations")
                c = Counting(conn)
                for k in range(0, len(events), 32):
                    async with conn.transaction():
                        deferred: dict[str, Any] = {}
                        scratch: dict[str, Any] = {}
                        for ev in events[k:k + 32]:
                            p = ev.payload()
                            tx = Tx(conn=c, now=0.0, source="t", schema="metering", deferred=deferred,
                                    scratch=scratch, own_savepoint=own_savepoint)
                            await HANDLERS[type(p)](tx, ev, p)
                        end = Tx(conn=c, now=0.0, source="t", schema="metering", scratch=scratch)
                        for work in deferred.values():
                            await work(end)
                rows = await conn.fetchval("SELECT count(*) FROM metering.allocations")
                mode = "savepoint per message" if own_savepoint else "optimistic batch"
                print(f"{mode}: {c.n} statements for {len(events)} facts in batches of 32 "
                      f"({c.n / len(events):.2f} per fact); {rows} allocations")
    finally:
        await pool.close()
        await drop_database(base, name)
asyncio.run(main())
