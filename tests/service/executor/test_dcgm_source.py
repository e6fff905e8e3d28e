"""The DCGM source against a real Prometheus scraping the fixture exporter, on the executor's real runtime
(Postgres, outbox): precise errors, GPU health that survives a restart, and recovery."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from services.executor.dcgm import PrometheusError, query_prometheus
from services.executor.sim import SimExecutor, SimExecutorSettings
from shared.config import DcgmSettings, parse_cluster
from shared.db import create_pool
from shared.events import NodeChanged, NodeInventory, UtilizationSampled, UtilizationSourceChecked
from shared.service import ServiceRuntime
from tests.support.dcgm_fixture import FixtureExporter, FixtureGpu
from tests.support.prometheus_process import free_port, query, running_prometheus

CLUSTER = parse_cluster({"node_groups": [{"name": "n", "count": 2, "gpus_per_node": 2, "gpu_model": "H100-80GB",
                                          "cpu_milli": 1000, "memory_mib": 1024}]})


def gpu(host: str, index: int, xid: float = 0) -> FixtureGpu:
    return FixtureGpu(host, index, "NVIDIA H100 80GB HBM3", {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.3,
                                                             "DCGM_FI_DEV_FB_USED": 100, "DCGM_FI_DEV_XID_ERRORS": xid})


@pytest.fixture
def exporter() -> Iterator[tuple[FixtureExporter, int]]:
    exp = FixtureExporter([gpu("n-0", 0), gpu("n-0", 1, xid=48), gpu("n-1", 0), gpu("n-1", 1)])
    port = exp.start()
    try:
        yield exp, port
    finally:
        exp.stop()


@pytest.fixture
def prometheus(tmp_path: Path, exporter: tuple[FixtureExporter, int]) -> Iterator[str]:
    with running_prometheus(tmp_path, {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "dcgm", "static_configs": [{"targets": [f"127.0.0.1:{exporter[1]}"]}]}],
    }) as url:
        yield url


@pytest_asyncio.fixture
async def runtime_factory(fresh: tuple[str, str]) -> AsyncIterator[Any]:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    runtimes: list[ServiceRuntime] = []

    async def make(settings: DcgmSettings) -> tuple[SimExecutor, ServiceRuntime]:
        executor = SimExecutor(SimExecutorSettings(cluster=CLUSTER, dcgm=settings))
        runtime = ServiceRuntime(executor.spec(), nats_url=nats_url, pool=pool)
        await runtime.prepare()  # schema, migrations, streams: no consumers, no background loops
        runtimes.append(runtime)
        return executor, runtime

    try:
        yield make
    finally:
        for r in runtimes:
            await r.broker.stop()
        await pool.close()


async def outbox(runtime: ServiceRuntime, subject: str) -> list[dict[str, Any]]:
    async with runtime.pool.acquire() as conn:
        rows = await conn.fetch("SELECT body FROM executor.outbox WHERE subject = $1 ORDER BY seq", subject)
    return [json.loads(r["body"])["data"] for r in rows]


async def wait_for_series(url: str, expr: str, want: float) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        result = (await asyncio.to_thread(query, url, expr))["result"]
        if result and all(float(r["value"][1]) == want for r in result):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"{expr} never became {want}")


async def test_errors_say_what_is_wrong(prometheus: str, exporter: tuple[FixtureExporter, int]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(PrometheusError) as err:
            await query_prometheus(client, prometheus, "avg_over_time(DCGM_FI_DEV_FB_USED[", time.time())
        assert err.value.reason == "QueryError" and "bad_data" in err.value.message
        with pytest.raises(PrometheusError) as err:  # not a Prometheus: the exporter itself
            await query_prometheus(client, f"http://127.0.0.1:{exporter[1]}", "up", time.time())
        assert err.value.reason == "HttpError" and "HTTP 404" in err.value.message
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(PrometheusError) as err:
            await query_prometheus(client, dead, "up", time.time())
        assert err.value.reason == "Unreachable" and f"cannot reach Prometheus at {dead}" in err.value.message


async def test_a_degraded_node_stays_degraded_across_a_restart_and_recovers_when_the_fault_clears(
        prometheus: str, exporter: tuple[FixtureExporter, int], runtime_factory: Any) -> None:
    settings = DcgmSettings(prometheus_url=prometheus, interval_s=1, lookback_s=1, timeout_s=1, recovery_polls=2)
    await wait_for_series(prometheus, 'DCGM_FI_DEV_XID_ERRORS{Hostname="n-0", gpu="1"}', 48)
    executor, runtime = await runtime_factory(settings)
    assert executor.dcgm is not None
    async with executor.dcgm.client() as client:
        outcome = await executor.dcgm.poll(runtime, client, time.time())
    assert outcome.ok and [c.node.name for c in outcome.changes] == ["n-0"]
    changed = await outbox(runtime, NodeChanged.subject())
    assert [(c["node"]["name"], c["node"]["health"], c["reason"]) for c in changed] == [("n-0", "degraded", "Xid48")]
    assert "XID 48 (double-bit ECC error) on GPU 1" in changed[0]["message"]
    sampled = await outbox(runtime, UtilizationSampled.subject())
    assert sorted(b["node"] for b in sampled) == ["n-0", "n-1"] and all(b["source"] == "dcgm" for b in sampled)
    checked = await outbox(runtime, UtilizationSourceChecked.subject())
    assert checked[-1]["ok"] and checked[-1]["gpus_unattributed"] == 4

    # A restart: the new executor announces its inventory with the node still degraded, and its source
    # remembers it (no second NodeChanged while the fault lasts).
    executor, runtime = await runtime_factory(settings)
    await executor.announce_inventory(runtime)
    inventory = (await outbox(runtime, NodeInventory.subject()))[-1]
    assert {n["name"]: n["health"] for n in inventory["nodes"]} == {"n-0": "degraded", "n-1": "ready"}
    assert executor.dcgm is not None
    async with executor.dcgm.client() as client:
        assert (await executor.dcgm.poll(runtime, client, time.time())).changes == []

        # The GPU is reset: after two clean polls the node is ready again.
        exporter[0].set("n-0", 1, "DCGM_FI_DEV_XID_ERRORS", 0)
        await wait_for_series(prometheus, 'max_over_time(DCGM_FI_DEV_XID_ERRORS{Hostname="n-0"}[1s])', 0)
        first = await executor.dcgm.poll(runtime, client, time.time())
        second = await executor.dcgm.poll(runtime, client, time.time())
    assert first.changes == [] and [(c.node.name, c.node.health.value) for c in second.changes] == [("n-0", "ready")]
    assert [c["node"]["health"] for c in await outbox(runtime, NodeChanged.subject())] == ["degraded", "ready"]
    async with runtime.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM executor.gpu_health") == 0
