"""Real GPU utilisation and health from dcgm-exporter, read through the Prometheus HTTP API.

The source runs inside an executor (a background loop of its service), because the executor owns the two facts
it needs and produces: which job runs where (for attribution), and the nodes (`NodeChanged` when a GPU fault
degrades one). An executor plugs it in by implementing `ExecutorView`: the simulated executor
(services/executor/sim.py) and the Kubernetes one (services/executor/kube/app.py) do.

Every `interval_s`, aligned to multiples of it (so replicas and restarts produce the same sample times, which
metering deduplicates), the source:
1. runs one PromQL query per DCGM field (core/dcgm_series.py) at that instant, concurrently, outside any
   transaction;
2. in one transaction: attributes the devices to jobs (core/attribution.py), decides node health
   (core/gpu_health.py), and emits one `UtilizationSampled` per node, a `NodeChanged` per health change, and a
   `UtilizationSourceChecked` with the poll's outcome (telemetry's `gpuq_utilization_source_up`).

When Prometheus cannot be reached or rejects a query, the poll logs a clear error (once per outage, then every
few minutes) and emits `UtilizationSourceChecked(ok=False, reason=...)`; nothing else changes, so the executor
and the scheduler go on as before: no samples and no health changes until Prometheus answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
import httpx

from services.core.executor.attribution import Attribution, Placements, attribute
from services.core.executor.dcgm_series import DcgmField, ParsedSeries, parse_results, queries
from services.core.executor.gpu_health import HealthChange, HealthMemory, HealthPolicy, assess
from shared.config import DcgmSettings
from shared.domain import NodeHealth, NodeSpec
from shared.events import NodeChanged, UtilizationSampled, UtilizationSourceChecked, utcnow_from
from shared.leader import lock_key
from shared.service import ServiceRuntime, Tx

log = logging.getLogger("gpuq.executor.dcgm")

SOURCE = "dcgm"
ERROR_REPEAT_S = 300.0  # while Prometheus stays unreachable, repeat the error this often (not every poll)

_HEALTH_SQL = """
CREATE TABLE IF NOT EXISTS {s}.gpu_health (
    node     text PRIMARY KEY,          -- degraded by the DCGM source; absent = no GPU fault known
    reason   text NOT NULL,
    message  text NOT NULL,
    since    double precision NOT NULL
)"""


class ExecutorView(Protocol):
    """What an executor tells the DCGM source: its nodes, and which job runs where."""

    def node_specs(self) -> Mapping[str, NodeSpec]:
        """The executor's nodes by name, with the health the executor itself gives them."""
        ...

    async def placements(self, conn: asyncpg.Connection) -> Placements:
        """Running jobs: by (namespace, pod), by device when the executor knows it, and per node."""
        ...

    async def node_announced(self, tx: Tx, node: NodeSpec) -> None:
        """The source has just announced `node` with a new health (NodeChanged, in `tx`): an executor that
        remembers what it announced, to announce only changes, records it here."""
        ...


class PrometheusError(Exception):
    def __init__(self, reason: str, message: str):
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


async def query_prometheus(client: httpx.AsyncClient, base_url: str, expr: str, at: float) -> list[dict[str, Any]]:
    """One instant query (`/api/v1/query`); returns `data.result`. Raises PrometheusError with a precise reason."""
    url = f"{base_url}/api/v1/query"
    try:
        resp = await client.get(url, params={"query": expr, "time": f"{at:.3f}"})
    except httpx.TimeoutException as exc:
        raise PrometheusError("Timeout", f"Prometheus at {base_url} did not answer within the timeout "
                                         f"({type(exc).__name__})") from None
    except httpx.HTTPError as exc:
        raise PrometheusError("Unreachable", f"cannot reach Prometheus at {base_url}: "
                                             f"{type(exc).__name__}: {exc}") from None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("status") == "error":
        raise PrometheusError("QueryError", f"Prometheus at {base_url} rejected {expr!r}: "
                                            f"{body.get('errorType')}: {body.get('error')}")
    if resp.status_code != 200:
        raise PrometheusError("HttpError", f"HTTP {resp.status_code} from {url}: {resp.text[:200]!r}")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError("BadResponse", f"{url} did not return an instant vector for {expr!r} "
                                             "(is this a Prometheus server?)")
    result: list[dict[str, Any]] = data["result"]
    return result


async def ensure_health_table(conn: asyncpg.Connection, schema: str) -> None:
    """The source keeps its table in the schema of the executor it is plugged into (created on first use)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(f"dcgm-health-{schema}"))
        await conn.execute(_HEALTH_SQL.format(s=schema))


async def degraded_nodes(conn: asyncpg.Connection, schema: str) -> dict[str, tuple[str, str]]:
    """Nodes the source has degraded: node -> (reason, message)."""
    rows = await conn.fetch(f"SELECT node, reason, message FROM {schema}.gpu_health ORDER BY node")
    return {r["node"]: (r["reason"], r["message"]) for r in rows}


def with_health(nodes: list[NodeSpec], degraded: Mapping[str, tuple[str, str]]) -> list[NodeSpec]:
    """The executor's nodes with the source's verdicts applied (for inventory announcements)."""
    return [n.model_copy(update={"health": NodeHealth.DEGRADED})
            if n.name in degraded and n.health is NodeHealth.READY else n for n in nodes]


@dataclass
class PollOutcome:
    at: float
    ok: bool
    reason: str | None = None
    message: str = ""
    parsed: ParsedSeries | None = None
    attribution: Attribution | None = None
    changes: list[HealthChange] = field(default_factory=list)


class DcgmSource:
    def __init__(self, settings: DcgmSettings, view: ExecutorView,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.settings = settings
        self.view = view
        self.queries = queries(settings)
        self.policy = HealthPolicy(frozenset(settings.ignore_xids), settings.missing_gpu_polls,
                                   settings.recovery_polls)
        self._transport = transport
        self.memory: HealthMemory | None = None  # loaded from the health table on the first poll
        self.last: PollOutcome | None = None
        self._down_since: float | None = None
        self._down_reason: str | None = None
        self._last_error_log = -math.inf
        self._warned: set[str] = set()
        self._empty_polls = 0

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.settings.timeout_s, transport=self._transport)

    # ------------------------------------------------------------------ the loop

    async def run(self, runtime: ServiceRuntime) -> None:
        """The executor's background loop: one poll per interval, at multiples of the interval."""
        interval = self.settings.interval_s
        async with self.client() as client:
            last_slot: float | None = None
            while True:
                now = runtime.clock.now()
                slot = math.floor(now / interval) * interval
                if slot == last_slot:
                    await asyncio.sleep(max(0.05, slot + interval - now))
                    continue
                last_slot = slot
                await self.poll(runtime, client, slot)

    async def fetch(self, client: httpx.AsyncClient, at: float) -> dict[DcgmField, list[dict[str, Any]]]:
        fields = sorted(self.queries, key=lambda f: f.value)
        results = await asyncio.gather(*(query_prometheus(client, self.settings.prometheus_url, self.queries[f], at)
                                         for f in fields), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return dict(zip(fields, results, strict=True))

    async def poll(self, runtime: ServiceRuntime, client: httpx.AsyncClient, at: float) -> PollOutcome:
        try:
            results = await self.fetch(client, at)
        except PrometheusError as exc:
            outcome = PollOutcome(at=at, ok=False, reason=exc.reason, message=exc.message)
            self._log_failure(outcome, runtime.clock.now())
            async with runtime.transaction() as tx:
                await tx.emit(self._checked(outcome), subject_suffix=None)
            self.last = outcome
            return outcome
        if self._down_since is not None:
            log.info("DCGM source: Prometheus at %s answers again after %.0f s; utilisation samples and GPU "
                     "health checks resume", self.settings.prometheus_url, at - self._down_since)
            self._down_since = self._down_reason = None
        parsed = parse_results(results, self.settings.labels)
        outcome = PollOutcome(at=at, ok=True, parsed=parsed)
        async with runtime.transaction() as tx:
            memory = self.memory
            if memory is None:
                await ensure_health_table(tx.conn, tx.schema)
                memory = HealthMemory(degraded=await degraded_nodes(tx.conn, tx.schema))
            nodes = self.view.node_specs()
            outcome.attribution = attribute(parsed, await self.view.placements(tx.conn), nodes)
            memory, outcome.changes = assess(parsed, nodes, memory, self.policy)
            await self._emit(tx, outcome)
        self.memory = memory  # only after commit: a rolled-back poll leaves the remembered health as it was
        self._warn_once(outcome)
        self.last = outcome
        return outcome

    async def _emit(self, tx: Tx, outcome: PollOutcome) -> None:
        assert outcome.attribution is not None
        sampled_at = utcnow_from(outcome.at)
        for batch in outcome.attribution.batches:
            await tx.emit(UtilizationSampled(node=batch.node, gpu_model=batch.gpu_model, sampled_at=sampled_at,
                                             interval_s=self.settings.interval_s, samples=batch.samples,
                                             source=SOURCE), subject_suffix=None)
        for change in outcome.changes:
            name = change.node.name
            if change.node.health is NodeHealth.DEGRADED:
                await tx.conn.execute(
                    f"INSERT INTO {tx.schema}.gpu_health(node, reason, message, since) VALUES ($1, $2, $3, $4) "
                    "ON CONFLICT (node) DO UPDATE SET reason = excluded.reason, message = excluded.message, "
                    "since = excluded.since", name, change.reason, change.message, outcome.at)
                log.error("DCGM source: node %s is degraded, no new placements there: %s", name, change.message)
            else:
                await tx.conn.execute(f"DELETE FROM {tx.schema}.gpu_health WHERE node = $1", name)
                log.warning("DCGM source: node %s: %s", name, change.message)
            await tx.emit(NodeChanged(node=change.node, change="updated", reason=change.reason,
                                      message=change.message))
            await self.view.node_announced(tx, change.node)
        await tx.emit(self._checked(outcome), subject_suffix=None)

    def _checked(self, outcome: PollOutcome) -> UtilizationSourceChecked:
        a, p = outcome.attribution, outcome.parsed
        return UtilizationSourceChecked(
            source=SOURCE, endpoint=self.settings.prometheus_url, ok=outcome.ok, reason=outcome.reason,
            message=outcome.message, checked_at=utcnow_from(outcome.at), interval_s=self.settings.interval_s,
            series=p.series if p else 0, series_dropped=sum(p.dropped.values()) if p else 0,
            gpus_exact=a.exact if a else 0, gpus_approximate=a.approximate if a else 0,
            gpus_unattributed=a.unattributed if a else 0)

    # ------------------------------------------------------------------ logging without flooding

    def _log_failure(self, outcome: PollOutcome, now: float) -> None:
        first = self._down_since is None or self._down_reason != outcome.reason
        if self._down_since is None:
            self._down_since = outcome.at
        self._down_reason = outcome.reason
        if first or now - self._last_error_log >= ERROR_REPEAT_S:
            self._last_error_log = now
            since = "" if first else f" (failing for {now - self._down_since:.0f} s)"
            log.error("DCGM source: %s%s; utilisation samples and GPU health checks are paused, scheduling "
                      "continues", outcome.message, since)

    def _warn_once(self, outcome: PollOutcome) -> None:
        a, p = outcome.attribution, outcome.parsed
        notes: list[str] = []
        if a is not None:
            notes += [f"series name node {n!r}, which this executor does not have (check the node label names: "
                      f"{', '.join(self.settings.labels.node)})" for n in a.unknown_nodes]
        if p is not None:
            notes += [f"{count} series dropped: {reason}" for reason, count in sorted(p.dropped.items())]
            self._empty_polls = self._empty_polls + 1 if p.series == 0 else 0
            # Not at the first polls: a Prometheus that just started may not have scraped the exporter yet.
            if self._empty_polls == max(3, math.ceil(60 / self.settings.interval_s)):
                notes.append(f"no dcgm-exporter series at {self.settings.prometheus_url} "
                             f"(selector {self.settings.selector or 'none'}): is dcgm-exporter scraped?")
        for note in notes:
            key = note.split(":")[0] if "dropped" in note else note
            if key not in self._warned or note.startswith("no dcgm-exporter series"):
                self._warned.add(key)
                log.warning("DCGM source: %s", note)
