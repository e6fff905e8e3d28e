"""Migrations expand; they never contract in the release that stops using what they would remove.

During a rolling upgrade the previous release's pods run against the schema the new pods have just migrated
(docs/install.md, "Upgrades while two releases run"). A migration may therefore add tables, columns, indexes,
functions; it may not drop a table, view, schema, sequence, type, function or column that the previous release may
still read or write. Such a drop belongs in a later release than the one that stopped using the object (expand, then
contract), and lands by adding its (service, file, object) to PAST_DROPS below in that later release, which a
review checks against the rule.

The check reads every `services/*/migrations/*.sql` as Postgres parses it: comments and the bodies of functions a
migration defines (which run only when called) are not statements it runs; DO blocks are (a DROP inside one counts).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# The drops that landed before this check, each in the release that stopped using the table (they broke the rule
# while two releases ran); kept as history. Nothing may be added here in the release that stops using an object.
PAST_DROPS = frozenset({
    ("admission", "008_cluster_from_scheduler.sql", "TABLE admission.nodes"),
    ("metering", "004_nodes_from_scheduler.sql", "TABLE metering.nodes"),
    ("preemption", "003_nodes_from_scheduler.sql", "TABLE preemption.nodes"),
    ("preemption", "004_jobs_from_owners.sql", "TABLE preemption.jobs"),
    ("telemetry", "003_nodes_from_scheduler.sql", "TABLE telemetry.nodes"),
})

_DOLLAR = re.compile(r"\$([A-Za-z_]\w*)?\$")
_DEFINES_ROUTINE = re.compile(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\b", re.I)
# What a statement may drop that the previous release may still use.
_KINDS = r"TABLE|VIEW|MATERIALIZED\s+VIEW|SCHEMA|SEQUENCE|TYPE|DOMAIN|FUNCTION|PROCEDURE"
_DROP_OBJECT = re.compile(rf"\bDROP\s+({_KINDS})\s+(?:IF\s+EXISTS\s+)?([\w.\"]+(?:\s*,\s*[\w.\"]+)*)", re.I)
# ALTER TABLE … DROP [COLUMN] [IF EXISTS] name: a column, unless the word after DROP names something else
# (DROP CONSTRAINT, ALTER COLUMN c DROP DEFAULT / NOT NULL / IDENTITY / EXPRESSION, or another statement's kind).
_NOT_A_COLUMN = (r"CONSTRAINT|DEFAULT|NOT|IDENTITY|EXPRESSION|TRIGGER|INDEX|POLICY|RULE|EXTENSION|OWNED|CAST|"
                 r"AGGREGATE|OPERATOR|ROLE|USER|DATABASE|SERVER|STATISTICS|PUBLICATION|SUBSCRIPTION|EVENT|"
                 r"COLLATION|CONVERSION|LANGUAGE|ACCESS|TRANSFORM|TEXT|FOREIGN|TABLESPACE|IF|COLUMN|" + _KINDS)
_ALTER_TABLE = re.compile(r"\bALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?:ONLY\s+)?([\w.\"]+)", re.I)
_DROP_COLUMN = re.compile(rf"\bDROP\s+(?:COLUMN\s+)?(?:IF\s+EXISTS\s+)?(?!(?:{_NOT_A_COLUMN})\b)([\w\"]+)", re.I)


def statements(sql: str, *, run: bool = False) -> list[str]:
    """The statements of `sql` as Postgres splits them, comments and string literals blanked; the body of a function
    or procedure a statement defines is left out, a DO block's body is kept (cleaned the same way, its literals kept:
    it may EXECUTE them). `run`: `sql` is such a body."""
    out: list[str] = []
    buf: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        if sql.startswith("--", i):
            i = sql.find("\n", i) if "\n" in sql[i:] else n
            buf.append(" ")
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = n if end < 0 else end + 2
            buf.append(" ")
        elif sql[i] in "'\"":
            end = i + 1
            while end < n and not (sql[end] == sql[i] and not sql.startswith(sql[i] * 2, end)):
                end += 2 if sql.startswith(sql[i] * 2, end) else 1
            buf.append(sql[i:end + 1] if run or sql[i] == '"' else "''")
            i = end + 1
        elif (m := _DOLLAR.match(sql, i)) is not None:
            end = sql.find(m.group(0), m.end())
            end = n if end < 0 else end
            body = sql[m.end():end]
            defines = _DEFINES_ROUTINE.match("".join(buf)) is not None
            buf.append(" <body> " if defines else " " + " ".join(statements(body, run=True)) + " ")
            i = end + len(m.group(0))
        elif sql[i] == ";":
            out.append("".join(buf))
            buf = []
            i += 1
        else:
            buf.append(sql[i])
            i += 1
    if "".join(buf).strip():
        out.append("".join(buf))
    return [" ".join(s.split()) for s in out if s.strip()]


def drops(sql: str) -> list[str]:
    """What the statements of `sql` drop: `TABLE admission.nodes`, `COLUMN metering.usage_hourly.gpu_model`, …"""
    found: list[str] = []
    for statement in statements(sql):
        for kind, names in _DROP_OBJECT.findall(statement):
            found += [f"{' '.join(kind.upper().split())} {name.strip().lower()}" for name in names.split(",")]
        if (table := _ALTER_TABLE.search(statement)) is not None:
            found += [f"COLUMN {table.group(1).lower()}.{col.lower()}" for col in _DROP_COLUMN.findall(statement)]
    return found


def contract_steps(root: Path) -> list[tuple[str, str, str]]:
    """Every (service, migration file, dropped object) under `root`/services."""
    return [(path.parent.parent.name, path.name, dropped)
            for path in sorted(root.glob("services/*/migrations/*.sql")) for dropped in drops(path.read_text())]


def refused(root: Path) -> list[str]:
    return [f"services/{service}/migrations/{name} drops {what}: a migration may only add while the previous "
            "release still runs; drop it in the release after the one that stopped using it (docs/install.md, "
            "\"Upgrades while two releases run\")"
            for service, name, what in contract_steps(root) if (service, name, what) not in PAST_DROPS]


def test_no_migration_drops_what_the_previous_release_may_use() -> None:
    assert refused(ROOT) == []


def test_the_past_drops_are_history_not_a_loophole() -> None:
    """The allow-list names exactly the drops that are there: none is stale, none was widened."""
    assert set(contract_steps(ROOT)) == PAST_DROPS


def test_a_new_dropping_migration_is_refused(tmp_path: Path) -> None:
    """In a copy of the migrations, a new release's migration that drops a table, a column and a view, hidden in
    lower case, behind IF EXISTS and inside a DO block, is refused, each drop named; the existing ones pass."""
    for directory in ROOT.glob("services/*/migrations"):
        shutil.copytree(directory, tmp_path / "services" / directory.parent.name / "migrations")
    assert refused(tmp_path) == []
    (tmp_path / "services" / "metering" / "migrations" / "006_contract.sql").write_text(
        "-- DROP TABLE in a comment drops nothing\n"
        "drop table if exists metering.rates;\n"
        "ALTER TABLE metering.usage_hourly DROP COLUMN gpu_model, ADD COLUMN model text;\n"
        "ALTER TABLE metering.jobs ALTER COLUMN user_name DROP NOT NULL, DROP CONSTRAINT jobs_pkey;\n"
        "DO $$ BEGIN EXECUTE 'DROP VIEW metering.v1_usage'; END $$;\n"
        "CREATE FUNCTION metering.later() RETURNS void LANGUAGE sql AS $f$ DROP TABLE metering.jobs $f$;\n")
    problems = refused(tmp_path)
    assert [p.split(": ")[0] for p in problems] == [
        "services/metering/migrations/006_contract.sql drops TABLE metering.rates",
        "services/metering/migrations/006_contract.sql drops COLUMN metering.usage_hourly.gpu_model",
        "services/metering/migrations/006_contract.sql drops VIEW metering.v1_usage",
    ]
    # The same drop in an existing migration that was not in it before is refused too (a file is not a licence).
    past = tmp_path / "services" / "admission" / "migrations" / "008_cluster_from_scheduler.sql"
    past.write_text(past.read_text() + "DROP TABLE admission.jobs;\n")
    assert any("008_cluster_from_scheduler.sql drops TABLE admission.jobs" in p for p in refused(tmp_path))


@pytest.mark.parametrize(("sql", "expected"), [
    ("ALTER TABLE a.t DROP c;", ["COLUMN a.t.c"]),
    ("ALTER TABLE a.t DROP COLUMN IF EXISTS c;", ["COLUMN a.t.c"]),
    ("ALTER TABLE a.t ALTER COLUMN c DROP DEFAULT;", []),
    ("ALTER TABLE a.t DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (x);", []),
    ("DROP SCHEMA old CASCADE;", ["SCHEMA old"]),
    ("DROP MATERIALIZED VIEW a.m;", ["MATERIALIZED VIEW a.m"]),
    ("DROP TABLE a.x, a.y;", ["TABLE a.x", "TABLE a.y"]),
    ("DROP INDEX a.i; DROP TRIGGER t ON a.t;", []),
    ("COMMENT ON TABLE a.t IS 'we never drop'; SELECT ';DROP TABLE a.t';", []),
])
def test_what_counts_as_a_drop(sql: str, expected: list[str]) -> None:
    assert drops(sql) == expected
