"""A rolling upgrade from the previous release to this tree, on one database and one bus, loses and duplicates nothing.

The previous release is the commit `deploy/previous-release` names, materialised from the repository's own history
(`git archive`); its services run as `gpuq up` processes with PYTHONPATH at that tree, on this environment's
interpreter and packages (its code must import with today's dependency versions), beside this tree's. The platform
starts on the previous release alone, then each part is replaced as a Deployment's rollout replaces its pod: the new
pod starts (migrating its schema), becomes ready (a singleton's as the standby), the old pod is stopped (a
singleton's standby takes the lease over). The order: metering and audit, the executor, the scheduler, preemption,
admission; so for a while the previous release's admission feeds this tree's scheduler, and this tree's
executor the previous release's scheduler. Jobs are submitted throughout, by a producer of this tree.

Every job is admitted, placed, started and completed exactly once (counted on the bus, where every decision is an
event, and in the owners' tables); no service dead-letters anything; and every audit record on the bus is stored once.
Audit's migration 002 changes the trail's key, so the previous audit service's inserts fail once it is applied
(docs/install.md, "Upgrades while two releases run"): the test applies it while that service still runs alone, sees
its inserts fail, and shows the records it could not store are stored by the new one: delayed, not lost.
docs/install.md, section 4."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import nats
import pytest
from nats.js import JetStreamContext

from shared.bus import streams
from shared.db import apply_migrations
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.servers import free_ports
from shared.service import publish_event
from tests.support.releases import ROOT, previous_release, release_env

SCHEMAS = ("admission", "scheduler", "preemption", "executor", "metering", "audit")
QUEUES_YAML = """\
priority_classes: [{name: normal, value: 100, preemptible: true}]
queues: [{name: team-a, teams: [team-a], quotas: {A100-80GB: {nominal: 32}}}]
gpu_flavors: {A100-80GB: {cost_per_gpu_hour: 2.0}}
"""
CLUSTER_YAML = """\
node_groups:
  - {name: a100, count: 4, gpus_per_node: 8, gpu_model: A100-80GB, cpu_milli: 96000, memory_mib: 1048576,
     nodes_per_rack: 2}
"""
# The job events each job must carry exactly once on the bus, and those none may carry in this run.
ONCE = ("io.gpuq.job.admitted.v1", "io.gpuq.job.placed.v1", "io.gpuq.job.started.v1", "io.gpuq.job.completed.v1")
NEVER = ("io.gpuq.job.rejected.v1", "io.gpuq.job.failed.v1", "io.gpuq.job.attempt_failed.v1",
         "io.gpuq.job.preempted.v1", "io.gpuq.job.requeued.v1", "io.gpuq.job.cancelled.v1")
# What the previous audit service says when its insert meets the partitioned trail (Postgres's words).
OLD_AUDIT_REFUSED = "no unique or exclusion constraint matching the ON CONFLICT specification"


class Pod:
    """One `gpuq up --services …` process of a release: what one Deployment's pod runs."""

    def __init__(self, name: str, tree: Path, services: tuple[str, ...], workdir: Path, env: dict[str, str]):
        self.name, self.services = name, services
        self.health_port, metrics_port = free_ports(2)
        self.log = workdir / f"{name}.log"
        home = workdir / name
        home.mkdir()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from cli.main import app; app()", "up", "--services", ",".join(services),
                 "--queues", str(workdir / "queues.yaml"), "--cluster", str(workdir / "cluster.yaml"),
                 "--health-port", str(self.health_port), "--health-addr", "127.0.0.1",
                 "--metrics-port", str(metrics_port), "--instance", name, "--log-level", "INFO"],
                # its own config file: `gpuq up` records its state directory there, not in the session's
                cwd=tree, env={**release_env(tree, env), "GPUQ_HOME": str(home),
                               "GPUQ_CONFIG": str(home / "config.yaml"), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
                stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def phases(self) -> dict[str, str]:
        try:
            async with httpx.AsyncClient() as client:
                body = (await client.get(f"http://127.0.0.1:{self.health_port}/readyz", timeout=5)).json()
        except (httpx.TransportError, ValueError):
            return {}
        return {name: str(s["phase"]) for name, s in body.get("services", {}).items()}

    async def wait_until(self, phases: set[str], timeout_s: float = 120.0) -> None:
        """Until every service of the pod is in one of `phases` (its /readyz)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.output()[-4000:]}"
            got = await self.phases()
            if set(got) == set(self.services) and set(got.values()) <= phases:
                return
            assert time.monotonic() < deadline, f"{self.name}: {got}, not {phases}:\n{self.output()[-4000:]}"
            await asyncio.sleep(0.3)

    async def stop(self) -> None:
        """SIGTERM, as Kubernetes stops a pod: a singleton gives its lease up on the way out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.proc.wait, 60)
        assert code == 0, f"{self.name} exited with {code}:\n{self.output()[-4000:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Producer:
    """Submits a small job every `every_s` until stopped, as a team's producer of this tree would."""

    def __init__(self, js: JetStreamContext, every_s: float = 0.6):
        self.js, self.every_s = js, every_s
        self.ids: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, job_id: str, gpus: int, duration_s: int) -> None:
        spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),),
                       max_runtime_s=600, labels={"sim.gpuq.io/duration-s": str(duration_s)})
        now = datetime.now(UTC)
        await publish_event(self.js, make_event(JobSubmitted(spec=spec, submitted_at=now), source="test", time=now),
                            JobSubmitted.scoped_subject("team-a"))
        self.ids.append(job_id)

    async def _run(self) -> None:
        for n in itertools.count(1):
            await self.submit(f"ru-{n:04d}", gpus=(1, 2, 4, 8)[n % 4], duration_s=1 + n % 3)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every_s)
                return

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task


async def stream_events(js: JetStreamContext, suffix: str) -> list[dict[str, object]]:
    """Every event in this session's stream `suffix` (JOBS, AUDIT, DLQ), in order."""
    name = next(s.name for s in streams() if s.name.endswith(f"_{suffix}"))
    state = (await js.stream_info(name)).state
    if not state.messages:
        return []
    return [json.loads((await js.get_msg(name, seq)).data or b"{}")
            for seq in range(state.first_seq, state.last_seq + 1)]


class Rollout:
    """The platform while it is upgraded: the pods of both releases, the database, the bus, the producer."""

    def __init__(self, old: Path, workdir: Path, env: dict[str, str], pool: asyncpg.Pool, js: JetStreamContext):
        self.old, self.workdir, self.env, self.pool, self.js = old, workdir, env, pool, js
        self.pods: list[Pod] = []
        self.producer = Producer(js)

    def start(self, name: str, tree: Path, *services: str) -> Pod:
        self.pods.append(Pod(name, tree, services, self.workdir, self.env))
        return self.pods[-1]

    async def wait_for(self, what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """Until `check()`; fails at once, naming them, when a service dead-letters anything."""
        deadline = time.monotonic() + timeout_s
        while not await check():
            letters = await self.dead_letters()
            assert not letters, f"dead letters while waiting for {what}: {letters}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.3)

    async def dead_letters(self) -> dict[str, list[dict[str, object]]]:
        found: dict[str, list[dict[str, object]]] = {}
        for schema in SCHEMAS:
            with contextlib.suppress(asyncpg.UndefinedTableError):  # a schema its service has not made yet
                rows = await self.pool.fetch(f"SELECT subject, reason, message FROM {schema}.dead_letters")
                if rows:
                    found[schema] = [dict(r) for r in rows]
        return found

    async def completed(self, ids: list[str]) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM executor.runs WHERE status = 'completed' "
                                            "AND job_id = ANY($1::text[])", ids))

    def done_at_least(self, n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return await self.completed(list(self.producer.ids)) >= n
        return check

    async def roll(self, new: Pod, old: Pod) -> None:
        """A Deployment's rolling update of one pod: the new one ready (a singleton's as the standby), then the old
        one stopped (SIGTERM), then the new one active."""
        await new.wait_until({"running", "standby"}, timeout_s=180)
        await old.stop()
        await new.wait_until({"running"}, timeout_s=120)

    async def upgrade(self) -> list[str]:
        """The previous release alone, then each part rolled to this tree's; returns the jobs submitted."""
        old = {"records": self.start("old-records", self.old, "metering", "audit"),
               "executor": self.start("old-executor", self.old, "executor"),
               "scheduler": self.start("old-scheduler", self.old, "scheduler"),
               "preemption": self.start("old-preemption", self.old, "preemption"),
               "admission": self.start("old-admission", self.old, "admission")}
        for pod in old.values():
            await pod.wait_until({"running"}, timeout_s=180)
        self.producer.start()
        await self.wait_for("jobs on the previous release", self.done_at_least(3), 120)

        # Metering and audit first. The new audit pod's first act is its migrations, 002 among them; while the
        # previous audit service still runs alone on the migrated trail, its inserts fail (retried with back-off).
        await apply_migrations(self.pool, "audit", ROOT / "services" / "audit" / "migrations")

        async def old_audit_refused() -> bool:
            return OLD_AUDIT_REFUSED in old["records"].output()
        await self.wait_for("the previous audit service refused by the partitioned trail", old_audit_refused, 60)
        await self.roll(self.start("new-records", ROOT, "metering", "audit"), old["records"])
        for part in ("executor", "scheduler", "preemption", "admission"):
            before = len(self.producer.ids)
            await self.roll(self.start(f"new-{part}", ROOT, part), old[part])
            # Jobs through each mix before the next part rolls.
            await self.wait_for(f"jobs after the {part} rolled", self.done_at_least(before + 2), 120)
        await self.producer.stop()
        ids = list(self.producer.ids)

        async def all_done() -> bool:
            return await self.completed(ids) == len(ids)
        await self.wait_for("every job completed", all_done, 180)
        return ids

    async def assert_once(self, ids: list[str]) -> None:
        # On the bus, where every decision is an event: each job admitted, placed, started, completed once.
        wanted = set(ids)
        counts = Counter((str(e["type"]), str(e["subject"])) for e in await stream_events(self.js, "JOBS")
                         if e.get("subject") in wanted)
        wrong = {(t, j): counts[(t, j)] for t in ONCE for j in ids if counts[(t, j)] != 1}
        wrong |= {(t, j): n for (t, j), n in counts.items() if t in NEVER}
        assert not wrong, f"events per job that should be once (or never): {wrong}"
        # In the owners' tables.
        assert await self.pool.fetchval("SELECT count(*) FROM admission.jobs WHERE job_id = ANY($1::text[])",
                                        ids) == len(ids)
        assert await self.completed(ids) == len(ids)
        # Metering consumes the completions after the executor wrote them: wait for its committed ledger (a job
        # charged twice never reaches one each, and times out).
        async def metered_once() -> bool:
            ends = await self.pool.fetch("SELECT job_id, count(*) AS n FROM metering.job_facts "
                                         "WHERE kind = 'completed' AND job_id = ANY($1::text[]) GROUP BY job_id", ids)
            return {r["job_id"]: r["n"] for r in ends} == dict.fromkeys(ids, 1)
        await self.wait_for("metering to hold each job's completion once", metered_once, 120)
        # Nothing dead-lettered by any service, old or new.
        assert await self.dead_letters() == {}
        assert await stream_events(self.js, "DLQ") == []

        # The audit trail: every record on the bus stored once, those the previous audit service failed to insert
        # included (delayed by the rollout, not lost).
        on_bus = sorted(str(e["id"]) for e in await stream_events(self.js, "AUDIT"))

        async def stored() -> bool:
            rows = await self.pool.fetch("SELECT event_id FROM audit.records")
            return sorted(r["event_id"] for r in rows) == on_bus
        await self.wait_for("the audit trail to hold every record on the bus, once", stored, 120)


@pytest.mark.timeout(600)
async def test_a_rolling_upgrade_from_the_previous_release_loses_and_duplicates_nothing(
        fresh: tuple[str, str], tmp_path: Path) -> None:
    nats_url, database_url = fresh
    (tmp_path / "queues.yaml").write_text(QUEUES_YAML)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url}
    nc = await nats.connect(nats_url)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        with previous_release() as old:
            rollout = Rollout(old, tmp_path, env, pool, nc.jetstream())
            try:
                ids = await rollout.upgrade()
                await rollout.assert_once(ids)
                for pod in rollout.pods:
                    if pod.proc.poll() is None:
                        await pod.stop()
            finally:
                for pod in rollout.pods:
                    pod.kill()
    finally:
        await pool.close()
        await nc.close()
