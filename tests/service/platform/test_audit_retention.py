"""The audit trail partitioned by month, on a real Postgres: migration 002 converts a trail that already holds
records in place (nothing copied, moved or lost, ids go on), the audit service stores records in the months' partitions
(made when missing), and retention drops whole months past the window while every record within it stays and single
records still cannot be updated, deleted or truncated."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from typer.testing import CliRunner

from cli.main import app
from services.audit import retention
from services.audit.app import MIGRATIONS, audit_retention, build_spec
from services.audit.records import read_records
from shared.clock import ManualClock
from shared.db import apply_migrations, create_pool
from shared.events import AuditRecorded, encode_event, make_event
from shared.retention import AUDIT
from shared.service import PLUMBING_SQL, ServiceRuntime

DAY = timedelta(days=1)


@pytest_asyncio.fixture
async def audit_db(make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[tuple[str, asyncpg.Pool]]:
    url = await make_database("audit")
    pool = await create_pool(url, min_size=1, max_size=4)
    try:
        yield url, pool
    finally:
        await pool.close()


async def migrate_first_release(pool: asyncpg.Pool, tmp_path: Path) -> None:
    """The audit schema as the release before partitioning left it: migration 001 only."""
    first = tmp_path / "migrations-001"
    first.mkdir()
    shutil.copy(MIGRATIONS / "001_init.sql", first / "001_init.sql")
    assert await apply_migrations(pool, "audit", first) == ["001_init.sql"]


async def insert_old_style(pool: asyncpg.Pool, rows: list[tuple[str, datetime]]) -> None:
    """Records as the previous release's audit service wrote them."""
    for event_id, at in rows:
        await pool.execute("INSERT INTO audit.records(event_id, recorder, at, action, actor, job_id) "
                           "VALUES ($1, 'scheduler', $2, 'place', 'service:scheduler', $1) "
                           "ON CONFLICT (event_id) DO NOTHING", event_id, at)


def recorded(job_id: str, at: datetime) -> tuple[bytes, str]:
    payload = AuditRecorded(action="place", actor="service:scheduler", at=at, job_id=job_id, team="team-a")
    return encode_event(make_event(payload, source="scheduler", time=at)), AuditRecorded.scoped_subject("scheduler")


async def runtime_for(pool: asyncpg.Pool, now: datetime) -> ServiceRuntime:
    """The audit service's unit of work on this database (handle() only: it never connects to NATS)."""
    await pool.execute(PLUMBING_SQL.format(s="audit"))
    return ServiceRuntime(build_spec(), nats_url="nats://127.0.0.1:1", pool=pool,
                          clock=ManualClock(now.timestamp()))


async def partitions(pool: asyncpg.Pool) -> dict[str, datetime]:
    return {r["name"]: r["upper"] for r in await pool.fetch("SELECT name, upper FROM audit.partitions")}


async def job_ids(pool: asyncpg.Pool) -> set[str]:
    return {r["job_id"] for r in await pool.fetch("SELECT job_id FROM audit.records")}


async def test_a_trail_with_records_becomes_partitioned_and_drops_whole_months_past_the_window(
        audit_db: tuple[str, asyncpg.Pool], tmp_path: Path) -> None:
    _, pool = audit_db
    now = datetime.now(UTC)
    await migrate_first_release(pool, tmp_path)
    await insert_old_style(pool, [("old-700", now - 700 * DAY), ("old-600", now - 600 * DAY)])
    before = await pool.fetch("SELECT id, event_id, at, stored_at FROM audit.records ORDER BY id")

    assert await apply_migrations(pool, "audit", MIGRATIONS) == ["002_partitioned_by_month.sql"]
    # Converted in place: the same rows, ids and times, now in the legacy partition.
    assert await pool.fetch("SELECT id, event_id, at, stored_at FROM audit.records ORDER BY id") == before
    assert {r["p"] for r in await pool.fetch("SELECT tableoid::regclass::text AS p FROM audit.records")} == {
        "audit.records_legacy"}
    assert await pool.fetchval("SELECT relkind FROM pg_class WHERE oid = 'audit.records'::regclass") == b"p"

    runtime = await runtime_for(pool, now)
    times = {"new-500": now - 500 * DAY, "new-395": now - 395 * DAY, "new-10": now - 10 * DAY, "new-0": now}
    events = {job: recorded(job, at) for job, at in times.items()}
    for raw, subject in events.values():
        assert await runtime.handle(raw, subject=subject) == "handled"
        assert await runtime.handle(raw, subject=subject) == "duplicate"
    # A record redelivered after its inbox row was pruned is still stored once: (event_id, at) is its key.
    await pool.execute("DELETE FROM audit.inbox")
    raw, subject = events["new-10"]
    assert await runtime.handle(raw, subject=subject) == "handled"
    assert await pool.fetchval("SELECT count(*) FROM audit.records") == 6
    ids = [r["id"] for r in await pool.fetch("SELECT id FROM audit.records ORDER BY id")]
    assert len(set(ids)) == 6 and min(ids[2:]) > max(r["id"] for r in before)  # the ids go on from the old ones

    async with pool.acquire() as conn:
        done = await retention.run_once(conn, now, 400)
    # The legacy partition (newest record 600 days old) and the month of the 500-day-old record are past 400 days;
    # the 395-day-old record's month ends after the cutoff, so it stays, as do the recent ones.
    assert done.dropped[0] == "records_legacy" and len(done.dropped) == 2
    assert await job_ids(pool) == {"new-395", "new-10", "new-0"}
    assert all(upper > now - 400 * DAY for upper in (await partitions(pool)).values())
    async with pool.acquire() as conn:
        assert (await retention.run_once(conn, now, 400)).dropped == []  # nothing more to drop

    # Every record still in the trail is append-only, through the table and through its partition.
    month = await pool.fetchval("SELECT tableoid::regclass::text FROM audit.records WHERE job_id = 'new-10'")
    for statement in ("UPDATE audit.records SET action = 'forged' WHERE job_id = 'new-10'",
                      "DELETE FROM audit.records WHERE job_id = 'new-10'",
                      f"DELETE FROM {month} WHERE job_id = 'new-10'",
                      f"UPDATE {month} SET actor = 'team:x' WHERE job_id = 'new-10'",
                      "TRUNCATE audit.records", f"TRUNCATE {month}"):
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await pool.execute(statement)
    assert await job_ids(pool) == {"new-395", "new-10", "new-0"}

    # The database's own floor: no month that ended less than 30 days ago goes, whatever the caller asks.
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.RaiseError, match="kept at least 30 days"):
            await retention.drop_expired(conn, now, 10)
    assert await job_ids(pool) == {"new-395", "new-10", "new-0"}


async def test_a_live_trail_keeps_its_legacy_partition_until_its_newest_month_is_past(
        audit_db: tuple[str, asyncpg.Pool], tmp_path: Path) -> None:
    _, pool = audit_db
    now = datetime.now(UTC)
    await migrate_first_release(pool, tmp_path)
    await insert_old_style(pool, [("old-900", now - 900 * DAY), ("yesterday", now - DAY)])
    await apply_migrations(pool, "audit", MIGRATIONS)
    async with pool.acquire() as conn:
        done = await retention.run_once(conn, now, 400)
        found = await read_records(conn, limit=10)
    # The legacy partition reaches into this month: it goes whole when that month is past the window, not before.
    assert "records_legacy" not in done.dropped and "records_legacy" in await partitions(pool)
    assert [r["job_id"] for r in found] == ["old-900", "yesterday"]


async def test_the_service_loop_and_gpuq_retention_run_the_same_pass(
        audit_db: tuple[str, asyncpg.Pool], monkeypatch: pytest.MonkeyPatch) -> None:
    url, pool = audit_db
    now = datetime.now(UTC)
    await apply_migrations(pool, "audit", MIGRATIONS)
    runtime = await runtime_for(pool, now)
    for job, at in (("a-500", now - 500 * DAY), ("b-450", now - 450 * DAY), ("c-1", now - DAY)):
        raw, subject = recorded(job, at)
        assert await runtime.handle(raw, subject=subject) == "handled"

    # The service's background loop: its first pass runs at start.
    loop = asyncio.create_task(audit_retention(400)(runtime))
    try:
        async def pruned() -> bool:
            return await job_ids(pool) == {"c-1"}

        for _ in range(200):
            if await pruned():
                break
            await asyncio.sleep(0.05)
        assert await pruned()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    # `gpuq retention` runs the same pass; a window below the floor is refused before anything is touched.
    raw, subject = recorded("d-600", now - 600 * DAY)
    assert await runtime.handle(raw, subject=subject) == "handled"
    monkeypatch.setenv("DATABASE_URL", url)
    res = await asyncio.to_thread(CliRunner().invoke, app, ["retention", "--audit-days", "20"])
    assert res.exit_code == 2 and "GPUQ_AUDIT_RETENTION_DAYS='20' is below its floor of 30 days" in res.output
    assert await job_ids(pool) == {"c-1", "d-600"}
    res = await asyncio.to_thread(CliRunner().invoke, app, ["retention", "--metering-raw-days", "0"])
    assert res.exit_code == 0, res.output
    assert "raw GPU samples: kept (no window)" in res.output and "(past 400 days)" in res.output
    assert await job_ids(pool) == {"c-1"}
    # This database has no metering ledger: said, not a traceback.
    res = await asyncio.to_thread(CliRunner().invoke, app, ["retention"])
    assert res.exit_code == 2 and "lacks the metering or audit schema" in res.output


def test_the_audit_window_is_read_from_the_environment_with_its_floor() -> None:
    assert AUDIT.days({}) == 400
    assert AUDIT.days({"GPUQ_AUDIT_RETENTION_DAYS": "0"}) is None
    assert AUDIT.days({"GPUQ_AUDIT_RETENTION_DAYS": "3650"}) == 3650
    with pytest.raises(ValueError, match="below its floor of 30 days"):
        AUDIT.days({"GPUQ_AUDIT_RETENTION_DAYS": "7"})
    with pytest.raises(ValueError, match="not a whole number of days"):
        AUDIT.days({"GPUQ_AUDIT_RETENTION_DAYS": "1y"})


@pytest.mark.parametrize(("env", "named"), [("GPUQ_AUDIT_RETENTION_DAYS", "floor of 30 days"),
                                            ("GPUQ_METERING_RAW_RETENTION_DAYS", "floor of 3 days")])
def test_gpuq_up_refuses_a_window_below_its_floor_before_starting_anything(env: str, named: str) -> None:
    queues = Path(__file__).resolve().parents[3] / "deploy" / "examples" / "queues.yaml"
    res = CliRunner().invoke(app, ["up", "--services", "audit,metering", "--queues", str(queues)], env={env: "2"})
    assert res.exit_code == 2 and f"{env}='2' is below its {named}" in " ".join(res.output.split())
