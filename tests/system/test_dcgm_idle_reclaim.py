"""Idle reclaim from real DCGM series (issue 48): a fixture dcgm-exporter scraped by a real Prometheus, read by the
simulated executor's DCGM source, through the whole stack on the real bus. The job class's idle reclaim
(`idle_for_s` 60, no grace, action `end`) ends the job whose GPUs the exporter shows at 2% (Cancelled, by telemetry,
audited idle_warn then idle_reclaim), and leaves the busy job running. Wall time: telemetry looks every minute; the job
is warned at the first look after a minute of idle samples and ended at the next, up to three minutes. (Fails on
the code before: nothing acts on idleness.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import pytest

from services.api.readmodel import fetch_status
from services.stack import Stack, StackSettings
from shared.config import DcgmSettings, parse_queues, queues_document
from shared.events import JobSubmitted, make_event
from shared.service import publish_event
from tests.support.dcgm_fixture import FixtureExporter
from tests.support.prometheus_process import free_port, running_prometheus
from tests.system.test_dcgm_pipeline import CLUSTER, IDLE, INTERVAL_S, PIPELINE, QUEUES, TRAIN, fixture_gpus, wait_for

pytestmark = pytest.mark.timeout(540)

RECLAIMING = parse_queues({**queues_document(QUEUES), "job_classes": {
    "training": {"idle": {"threshold_pct": 5, "idle_for_s": 60, "grace_s": 0, "action": "end"}}}})


async def test_the_job_dcgm_shows_idle_is_ended_and_the_busy_one_runs_on(fresh: tuple[str, str],
                                                                          tmp_path: Path) -> None:
    nats_url, database_url = fresh
    exporter = FixtureExporter(fixture_gpus())
    exporter_port = exporter.start()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "dcgm-exporter", "static_configs": [{
                  "targets": [f"127.0.0.1:{exporter_port}"],
                  "labels": {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-7x2kq"}}]}]}
    try:
        with running_prometheus(tmp_path, config) as prom_url:
            dcgm = DcgmSettings(prometheus_url=prom_url, interval_s=INTERVAL_S, lookback_s=2 * INTERVAL_S,
                                timeout_s=INTERVAL_S, selector='job="dcgm-exporter"', missing_gpu_polls=2,
                                recovery_polls=2)
            settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=RECLAIMING,
                                     cluster=CLUSTER, services=PIPELINE, metrics_port=free_port(), dcgm=dcgm)
            async with Stack(settings):
                await scenario(nats_url, database_url)
    finally:
        exporter.stop()


async def scenario(nats_url: str, database_url: str) -> None:
    nc = await nats.connect(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        js = nc.jetstream()
        for s in (TRAIN, IDLE):
            now = datetime.now(UTC)
            await publish_event(js, make_event(JobSubmitted(spec=s, submitted_at=now), source="test", time=now),
                                JobSubmitted.scoped_subject(s.team))

        async def states() -> dict[str, str]:
            return {r["job_id"]: r["state"] for r in await fetch_status(database_url, None)}

        async def running() -> bool:
            now = await states()
            return all(now.get(j) == "running" for j in ("train", "idle"))

        await wait_for("both jobs to run", running)

        async def idle_ended() -> str | None:
            return await conn.fetchval("SELECT outcome FROM admission.jobs WHERE job_id = 'idle'")

        assert await wait_for("the idle job to be ended", idle_ended, timeout=300) == "Cancelled"
        assert (await states())["train"] == "running"

        # telemetry's audit records (published through its outbox)
        rows = await conn.fetch("SELECT body FROM telemetry.outbox ORDER BY seq")
        records = [json.loads(bytes(r["body"]))["data"] for r in rows]
        assert [(a["action"], a["job_id"]) for a in records if a.get("action", "").startswith("idle")] == [
            ("idle_warn", "idle"), ("idle_reclaim", "idle")]
    finally:
        await nc.close()
        await conn.close()
