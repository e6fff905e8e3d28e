"""`gpuq bench e2e` reports a run's footprint for sizing (docs/install.md, "Sizing"): each service process's CPU
seconds and peak RSS, the run's own database (growth, rows, pg_stat_database, its backends' CPU and connections),
its streams, and the NATS server it started for itself. A small run in the Helm chart's layout, on the real
Postgres and a real NATS server; the figures are checked for presence and consistency, never against the clock."""

from __future__ import annotations

import pytest
from rich.progress import Progress

from gpuq_tools.bench.e2e import _run
from services.executor.sim import SAMPLE_INTERVAL_ENV
from shared import namespace as namespaces
from shared.servers import Servers

SERVICES = ("admission", "scheduler", "executor", "preemption", "metering", "telemetry")
NODES, JOBS = 6, 24


async def test_a_small_run_reports_its_footprint(servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    # the bench sets these for the stack it starts: undone after the test (the session's namespace is the tests')
    monkeypatch.setenv(namespaces.ENV, namespaces.current())
    monkeypatch.setenv(SAMPLE_INTERVAL_ENV, "30")
    monkeypatch.setenv("DATABASE_URL", servers.database_url)
    with Progress(disable=True) as progress:
        out = await _run("burst", nodes=NODES, queues=2, jobs=JOBS, rate=0.0, seconds=0.0, waiting=0, duration=0.0,
                         services=",".join(SERVICES), attach=False, timeout=120.0, progress=progress,
                         layout="processes", own_nats=True, hold=2.0, sample_interval=0.2)
    assert out["placed"] == JOBS
    sizing = out["sizing"]

    # every service process, with the CPU it used since it started (its start-up included: more than the timed
    # window's) and a peak RSS no smaller than the RSS it had at the end of the window
    assert set(sizing["services"]) == set(SERVICES)
    for name, figures in sizing["services"].items():
        assert figures["cpu_s"] > 0 and figures["cpu_s"] >= out["gpuq_cpu_s"][name]
        assert figures["peak_rss_mib"] >= out["gpuq_rss_mib"][name] > 0
    assert sizing["services_cpu_s"] == pytest.approx(sum(f["cpu_s"] for f in sizing["services"].values()), abs=0.05)

    # the run's own database: grown, holding each job and node, its counters and its backends its own
    pg = sizing["postgres"]
    assert pg["database_mib_end"] > pg["database_mib_start"] > 0
    assert pg["database_growth_mib"] == pytest.approx(pg["database_mib_end"] - pg["database_mib_start"], abs=0.15)
    assert pg["tables"]["admission.jobs"]["rows"] == JOBS
    assert pg["tables"]["scheduler.nodes"]["rows"] == NODES
    assert pg["rows"] == sum(s["rows"] for s in pg["schemas"].values()) >= JOBS + NODES
    assert {"admission", "scheduler", "executor", "metering"} <= set(pg["schemas"])
    assert pg["stat_database"]["xact_commit"] > 0
    assert pg["stat_database"]["tup_inserted"] >= JOBS + NODES
    assert pg["stat_database"]["active_time_s"] > 0
    assert pg["peak_connections"] >= len(SERVICES)  # a pool per service at least
    assert pg["backends_cpu_s"] > 0 and pg["backends_seen"] >= pg["peak_connections"]

    # the run's streams: every submission on the job stream
    bus = sizing["nats"]
    assert bus["streams"] and all(name.startswith("BENCH_") for name in bus["streams"])  # the run's namespace's
    jobs_stream = next(v for k, v in bus["streams"].items() if k.endswith("_JOBS"))
    assert jobs_stream["messages"] >= JOBS and jobs_stream["mib"] > 0
    assert bus["messages"] == sum(s["messages"] for s in bus["streams"].values())

    # the NATS server the run started for itself: its own figures
    server = bus["server"]
    assert server is not None
    assert server["cpu_s"] > 0 and server["peak_rss_mib"] > 0 and server["rss_mib"] > 0
    assert server["in_msgs"] >= JOBS and server["jetstream_store_mib"] > 0

    # the hold after the burst: each process's CPU meanwhile, in cores (how much is the machine's business: only
    # that every process is there and none went backwards)
    hold = out["hold"]
    assert set(hold["cores"]) == {*SERVICES, "nats-server", "postgres-backends"}
    assert all(v >= 0 for v in hold["cores"].values())
    assert hold["services_cores"] == pytest.approx(sum(hold["cores"][s] for s in SERVICES), abs=0.01)
    assert hold["seconds"] >= 2.0 and hold["utilization_events_per_s"] >= 0
