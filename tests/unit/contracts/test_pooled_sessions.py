"""Pooled connections go back to the pool without asyncpg's reset query (shared/db.py keep_session), so no code
may leave state in a pooled connection's session: a session-level advisory lock, a LISTEN, a session SET, a held
cursor or a prepared statement would reach whoever acquires the connection next. Two places hold session state on
purpose: the leader lease, on a connection of its own (never pooled), and the migration lock, released before its
connection goes back (or the connection closed)."""

from __future__ import annotations

from pathlib import Path

from shared.db import SESSION_STATE_RE

ROOT = Path(__file__).resolve().parents[3]
# file -> how many session-state statements it may hold, and why
ALLOWED = {
    "shared/db.py": 1,  # apply_migrations' pg_advisory_lock, unlocked in `finally` (or the connection terminated)
}


def _sources() -> list[Path]:
    files = [p for d in ("shared", "services", "cli") for p in sorted((ROOT / d).rglob("*.py"))]
    files += sorted((ROOT / "services").glob("*/migrations/*.sql"))
    return files


def test_no_pooled_code_leaves_state_in_its_session() -> None:
    found: dict[str, list[str]] = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "shared/leader.py":
            continue  # its lock lives on a dedicated connection (checked below)
        hits = [m.group(0) for m in SESSION_STATE_RE.finditer(path.read_text())]
        if len(hits) > ALLOWED.get(rel, 0):
            found[rel] = hits
    assert not found, ("session state in pooled code (it outlives the unit of work; see shared/db.py "
                       f"keep_session): {found}")


def test_the_leader_lease_holds_its_lock_on_a_connection_of_its_own() -> None:
    text = (ROOT / "shared/leader.py").read_text()
    assert "asyncpg.connect(" in text and "pool" not in text.replace("pooled", "")


def test_the_pattern_tells_session_state_from_transaction_state() -> None:
    session = ["SELECT pg_advisory_lock($1)", "SELECT pg_try_advisory_lock_shared($1)", "LISTEN jobs",
               "SET search_path TO admission", "SET SESSION statement_timeout = 0", "SET TIME ZONE 'UTC'",
               "SELECT set_config('search_path', 'x', false)", "DECLARE c NO SCROLL CURSOR WITH HOLD FOR SELECT 1",
               "PREPARE q AS SELECT 1"]
    transaction = ["SELECT pg_advisory_xact_lock($1)", "SET LOCAL statement_timeout = 5",
                   "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", "UPDATE admission.jobs SET status = 'a'",
                   "SELECT set_config('search_path', 'x', true)", "DECLARE c CURSOR FOR SELECT 1"]
    assert [s for s in session if not SESSION_STATE_RE.search(s)] == []
    assert [s for s in transaction if SESSION_STATE_RE.search(s)] == []
