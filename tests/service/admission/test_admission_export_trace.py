"""What-if on the platform's own history (issue 49 item 6), on real NATS + Postgres: jobs run through the admission
service (submitted, placed, started, ended on the platform clock), `gpuq export-trace` writes them as a simulator
trace with the cluster and the queues in force, and `gpuq simulate` replays the export against them and against a
changed queues.yaml: the replay sees the same jobs, with their shapes, classes, queues, limits and run times."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import nats
import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import ClusterConfig, parse_queues
from shared.db import create_pool
from shared.domain import CheckpointSpec, GpuBinding, JobSpec, PodSet
from shared.events import JobCompleted, JobPlaced, JobStarted, JobSubmitted, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime
from sim.loaders import load_generic_csv
from tests.service.admission.test_admission_service import until
from tests.support.cluster import record_nodes
from tests.unit.telemetry.telemetry_builders import node

QUEUES = {"priority_classes": [{"name": "normal", "value": 100}, {"name": "high", "value": 500,
                                                                    "preemptible": False}],
          "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100": {"nominal": 8}}},
                     {"name": "team-b", "teams": ["team-b"], "quotas": {"H100": {"nominal": 8}}}]}
# job -> (queue, pods, GPUs per pod, class, limit, checkpoint interval or None, run time)
JOBS = {"a1": ("team-a", 1, 4, "normal", 7200, 600, 1800.0),
        "a2": ("team-a", 2, 2, "high", 3600, None, 600.0),
        "b1": ("team-b", 1, 8, "normal", 86_400, 900, 5400.0)}


def _spec(job_id: str) -> JobSpec:
    queue, pods, per_pod, cls, limit, ckpt, _ran = JOBS[job_id]
    return JobSpec(job_id=job_id, team=queue, queue=queue, priority_class=cls, max_runtime_s=limit,
                   pod_sets=(PodSet(count=pods, gpus_per_pod=per_pod, gpu_models=("H100",)),),
                   checkpoint=CheckpointSpec(supported=ckpt is not None, interval_s=ckpt))


def _event(body: object, at: float) -> bytes:
    when = datetime.fromtimestamp(at, UTC)
    return encode_event(make_event(body, source="test", time=when))  # type: ignore[arg-type]


async def _status(conn: asyncpg.Connection, job_id: str, status: str) -> bool:
    return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id) == status


async def _run_jobs(nats_url: str, database_url: str) -> float:
    """Run JOBS through admission on a manual clock (and leave one job waiting); returns the first submission."""
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    svc = ServiceRuntime(AdmissionService(parse_queues(QUEUES)).spec(), nats_url=nats_url, pool=pool, clock=clock,
                         database_url=database_url)
    await svc.start()
    first = clock.now()
    try:
        await record_nodes(pool, (node("h0"), node("h1")))
        for i, job_id in enumerate(JOBS):  # (admission stamps a submission with its own clock)
            clock.set(at := first + 10 * i)
            await js.publish(ns_subject(f"job.submitted.{JOBS[job_id][0]}"),
                             _event(JobSubmitted(spec=_spec(job_id), submitted_at=datetime.fromtimestamp(at, UTC)),
                                    at))
            await until(lambda j=job_id: _status(conn, j, "admitted"))
        for job_id, host in (("a1", "h0"), ("a2", "h0"), ("b1", "h1")):
            spec = _spec(job_id)
            bindings = tuple(GpuBinding(pod=f"main-{p}", node=host, gpu_indices=(p,)) for p in range(spec.total_gpus))
            await js.publish(ns_subject("job.placed"), _event(JobPlaced(
                job_id=job_id, spec=spec, placed_at=datetime.fromtimestamp(clock.now(), UTC), bindings=bindings),
                clock.now()))
        clock.advance(60.0)
        started = clock.now()
        for job_id in JOBS:
            await js.publish(ns_subject("job.started"), _event(JobStarted(
                job_id=job_id, started_at=datetime.fromtimestamp(started, UTC)), started))
        await until(lambda: _count(conn, "SELECT count(*) FROM admission.jobs WHERE started_at IS NOT NULL", 3))
        for job_id in sorted(JOBS, key=lambda j: JOBS[j][6]):  # each ends after its run time, on the platform clock
            clock.set(started + JOBS[job_id][6])
            await js.publish(ns_subject("job.completed"), _event(JobCompleted(
                job_id=job_id, finished_at=datetime.fromtimestamp(clock.now(), UTC)), clock.now()))
            await until(lambda j=job_id: _status(conn, j, "finished"))
        # a job that never ran: not in the trace (counted as left out)
        waiting = JobSpec(job_id="w1", team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=1),))
        await js.publish(ns_subject("job.submitted.team-a"),
                         _event(JobSubmitted(spec=waiting, submitted_at=datetime.fromtimestamp(first + 30, UTC)),
                                first + 30))
        await until(lambda: _count(conn, "SELECT count(*) FROM admission.jobs WHERE job_id = 'w1'", 1))
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()
    return first


async def _count(conn: asyncpg.Connection, sql: str, expected: int) -> bool:
    return await conn.fetchval(sql) == expected


async def test_export_trace_writes_the_platforms_jobs_and_simulate_replays_them_against_changed_queues(
        fresh: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nats_url, database_url = fresh
    first = await _run_jobs(nats_url, database_url)
    monkeypatch.setenv("DATABASE_URL", database_url)
    trace, cluster, queues = tmp_path / "trace.csv", tmp_path / "cluster.yaml", tmp_path / "queues.yaml"
    runner = CliRunner()
    since = datetime.fromtimestamp(first - 1, UTC).isoformat()
    res = await asyncio.to_thread(runner.invoke, app, [
        "export-trace", "--since", since, "--until", str(first + 86_400), "--out", str(trace),
        "--cluster-out", str(cluster), "--queues-out", str(queues)])
    assert res.exit_code == 0, res.output
    assert "3 jobs written; left out: 1 waiting or running" in res.output

    # the trace as the simulator loads it: the same jobs, shapes, classes, queues, limits, checkpointing, run times
    nodes = ClusterConfig.model_validate(yaml.safe_load(cluster.read_text())).nodes()
    assert sorted((n.gpu_model, n.gpus) for n in nodes) == [("H100", 8), ("H100", 8)]
    loaded = load_generic_csv(trace, nodes, None)
    got = {j.job_id: (j.queue, j.pods, j.gpus_per_pod, j.priority_class, j.max_runtime_s, j.checkpoint_interval_s,
                      float(j.duration)) for j in loaded.jobs}
    assert got == JOBS
    assert [j.submit_time for j in loaded.jobs] == [0, 10, 20]  # submission times kept (from the first)
    assert all(j.gpu_models == ("H100",) for j in loaded.jobs)

    # replayed against the queues in force, then against a changed queues.yaml (team-a's quota doubled)
    doc = yaml.safe_load(queues.read_text())
    assert [q["name"] for q in doc["queues"]] == ["team-a", "team-b"]
    changed = tmp_path / "changed.yaml"
    doc["queues"][0]["quotas"]["H100"]["nominal"] = 16
    changed.write_text(yaml.safe_dump(doc))
    for name, qfile in (("baseline", queues), ("changed", changed)):
        out = tmp_path / f"{name}.json"
        res = await asyncio.to_thread(runner.invoke, app, [
            "simulate", "--trace", str(trace), "--cluster", str(cluster), "--queues", str(qfile), "--policy", "gpuq",
            "--json", str(out)])
        assert res.exit_code == 0, res.output
        result = json.loads(out.read_text())["results"][0]
        assert (result["jobs"], result["completed"]) == (3, 3)
        assert set(result["per_team"]) == {"team-a", "team-b"}
