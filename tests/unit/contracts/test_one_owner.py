"""Each fact has one owner (docs/architecture.md, "Who owns which fact"): the scheduler owns the nodes and the
allocations, and other services read its read model (services/scheduler/readmodel.py) or take events, never
keep a table of them. These checks fail on the code before the read model: admission, preemption, metering and
telemetry each created a `nodes` table and consumed the inventory to fill it; and preemption kept a table of every
job (spec, bindings, placement, start, status) from the job events."""

from __future__ import annotations

import re
from pathlib import Path

from services.admission.app import AdmissionService
from services.metering.app import SPEC as METERING
from services.preemption.app import PreemptionService
from services.scheduler.app import SchedulerService
from services.telemetry.app import TelemetryService
from shared.bus import consumer_plan
from shared.config import parse_queues
from shared.events import JobCheckpointed, JobPlaced, NodeChanged, NodeInventory

ROOT = Path(__file__).resolve().parents[3]
QUEUES = parse_queues({"priority_classes": [{"name": "normal", "value": 1}],
                       "queues": [{"name": "q", "quotas": {"H100": {"nominal": 8}}}]})
CREATE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?([a-z_]+)\.([a-z_]+)", re.I)
DROP = re.compile(r"DROP\s+TABLE\s+(?:IF\s+EXISTS\s+)?([a-z_]+)\.([a-z_]+)", re.I)


def tables_after_migrations() -> set[tuple[str, str]]:
    """Every table the services' migrations leave, replaying CREATE and DROP TABLE in each service's order."""
    tables: set[tuple[str, str]] = set()
    for directory in sorted((ROOT / "services").glob("*/migrations")):
        for path in sorted(directory.glob("*.sql")):
            sql = re.sub(r"--[^\n]*", "", path.read_text())
            for statement in sql.split(";"):
                if m := CREATE.search(statement):
                    tables.add((m[1].lower(), m[2].lower()))
                elif m := DROP.search(statement):
                    tables.discard((m[1].lower(), m[2].lower()))
    return tables


def test_only_the_scheduler_keeps_a_table_of_nodes() -> None:
    node_tables = sorted(t for t in tables_after_migrations() if "node" in t[1])
    # executor.kube_nodes is what the Kubernetes executor observed of its API server: the source of NodeInventory.
    # executor.kube_node_idle is the executor's own scale-down clock (since when it ran no pod of gpuq's on a node,
    # which decides when it lifts its own scale-down-disabled annotation): no capacity, health or placement in it.
    assert node_tables == [("executor", "kube_node_idle"), ("executor", "kube_nodes"), ("scheduler", "nodes")]


def test_node_events_reach_only_the_owner_and_live_gauges() -> None:
    specs = [SchedulerService().spec(), AdmissionService(QUEUES).spec(), PreemptionService(QUEUES).spec(), METERING,
             TelemetryService(metrics_port=None, webhook_worker=False).spec()]
    consumers = {s.name for s in specs for event in (NodeInventory, NodeChanged) if event in s.handlers}
    # Telemetry folds them into its gauges in memory only (it reloads nodes from the read model at start).
    assert consumers == {"scheduler", "telemetry"}


# ---------------------------------------------------------------------- who holds which GPUs: the scheduler

ALTER = re.compile(r"ALTER\s+TABLE\s+([a-z_]+)\.([a-z_]+)\s", re.I)
ADD_COLUMN = re.compile(r"ADD\s+COLUMN\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I)
DROP_COLUMN = re.compile(r"DROP\s+COLUMN\s+(?:IF\s+EXISTS\s+)?(\w+)", re.I)
NOT_A_COLUMN = {"primary", "unique", "check", "foreign", "constraint", "exclude"}


def column_names(body: str) -> set[str]:
    """The column names of a CREATE TABLE's parenthesised body (commas inside parentheses split nothing)."""
    depth, parts, part = 0, [], ""
    for ch in body:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts, part = [*parts, part], ""
        else:
            part += ch
    words = [p.split()[0].lower() for p in [*parts, part] if p.split()]
    return {w for w in words if w not in NOT_A_COLUMN}


def columns_after_migrations() -> dict[tuple[str, str], set[str]]:
    """The columns of every table the services' migrations leave (CREATE TABLE, ALTER TABLE ... ADD / DROP COLUMN,
    DROP TABLE), replayed in each service's order."""
    tables: dict[tuple[str, str], set[str]] = {}
    for directory in sorted((ROOT / "services").glob("*/migrations")):
        for path in sorted(directory.glob("*.sql")):
            sql = re.sub(r"--[^\n]*", "", path.read_text())
            for statement in sql.split(";"):
                if m := CREATE.search(statement):
                    tables[(m[1].lower(), m[2].lower())] = column_names(
                        statement[statement.index("(") + 1:statement.rindex(")")])
                elif m := DROP.search(statement):
                    tables.pop((m[1].lower(), m[2].lower()), None)
                elif (m := ALTER.search(statement)) and (key := (m[1].lower(), m[2].lower())) in tables:
                    tables[key] |= {c.lower() for c in ADD_COLUMN.findall(statement)}
                    tables[key] -= {c.lower() for c in DROP_COLUMN.findall(statement)}
    return tables


def test_preemption_keeps_no_copy_of_placements_or_of_admission() -> None:
    """The running jobs (spec, bindings, placement and start) are read from the scheduler's read model, a preemptor
    from admission's: preemption's tables hold its protocol and the checkpoints it was told of, nothing else.
    (Fails on the code before: preemption.jobs mirrored JobSubmitted/Admitted/Placed/Started and the ends.)"""
    tables = columns_after_migrations()
    assert "bindings" in tables[("scheduler", "jobs")]  # the replay sees the owner's columns
    mine = {table: columns for (schema, table), columns in tables.items() if schema == "preemption"}
    assert sorted(mine) == ["checkpoints", "config", "deferred", "preemptions", "requests"]
    copied = {"spec", "bindings", "placed_at", "started_at", "status", "allowed_models", "flavors"}
    assert {table: sorted(columns & copied) for table, columns in mine.items() if columns & copied} == {}


def test_preemption_consumes_no_placement_and_no_job_event_but_the_checkpoint() -> None:
    """It decides from the owners' read models, so the one job event it takes is its protocol's answer; its JOBS
    consumer filters on that subject and receives no other job event (fewer deliveries per job)."""
    spec = PreemptionService(QUEUES).spec()
    assert JobPlaced not in spec.handlers
    assert {cls for cls in spec.handlers if cls.aggregate == "job"} == {JobCheckpointed}
    jobs = [plan for plan in consumer_plan(spec.handlers) if plan.stream.name.endswith("_JOBS")]
    assert [plan.filters(multi_filter) for plan in jobs for multi_filter in (False, True)] == \
        [(JobCheckpointed.subscription(),)] * 2


# ---------------------------------------------------------------------- the queue configuration: admission

def test_only_admission_records_the_queue_configuration() -> None:
    """The configuration in force and its versions are admission's (docs/admission.md, "The configuration in
    force"): other services read its read model, none keeps a copy. (Fails on the code before: preemption recorded
    the file at its first start and every QueueConfigChanged in preemption.config, and kept running on that copy
    after a helm upgrade changed the file.)"""
    writes = re.compile(r"(?:INSERT\s+INTO|UPDATE)\s+([a-z_]+)\.config\b", re.I)
    writers = {(path.relative_to(ROOT).as_posix(), m[1]) for path in sorted((ROOT / "services").rglob("*.py"))
               for m in writes.finditer(path.read_text())}
    assert {schema for _, schema in writers} == {"admission"}, sorted(writers)
    assert {path for path, _ in writers} == {"services/admission/app.py"}
