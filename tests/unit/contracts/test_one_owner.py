"""Each fact has one owner (docs/architecture.md, "Who owns which fact"): the scheduler owns the nodes and the
allocations, and other services read its read model (services/scheduler/readmodel.py) or take events, never
keep a table of them. These checks fail on the code before the read model: admission, preemption, metering and
telemetry each created a `nodes` table and consumed the inventory to fill it."""

from __future__ import annotations

import re
from pathlib import Path

from services.admission.app import AdmissionService
from services.metering.app import SPEC as METERING
from services.preemption.app import PreemptionService
from services.scheduler.app import SchedulerService
from services.telemetry.app import TelemetryService
from shared.config import parse_queues
from shared.events import NodeChanged, NodeInventory

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
    assert node_tables == [("executor", "kube_nodes"), ("scheduler", "nodes")]


def test_node_events_reach_only_the_owner_and_live_gauges() -> None:
    specs = [SchedulerService().spec(), AdmissionService(QUEUES).spec(), PreemptionService(QUEUES).spec(), METERING,
             TelemetryService(metrics_port=None, webhook_worker=False).spec()]
    consumers = {s.name for s in specs for event in (NodeInventory, NodeChanged) if event in s.handlers}
    # Telemetry folds them into its gauges in memory only (it reloads nodes from the read model at start).
    assert consumers == {"scheduler", "telemetry"}
