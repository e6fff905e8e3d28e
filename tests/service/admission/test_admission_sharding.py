"""Admission as one active instance per cohort, on real NATS + Postgres: two instances for different cohorts run
side by side and each acts only for its own cohorts (together deciding what one instance decides); two
instances for the same cohort lead one at a time; a queue moved to another cohort moves to that cohort's
instance with its jobs; an all-cohorts instance and per-cohort instances never run at the same time."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import nats
import pytest_asyncio

from services.admission.app import AdmissionService
from shared import namespace
from shared.bus import delete_streams, ensure_streams
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import JobSpec, PodSet
from shared.events import JobCompleted, JobSubmitted, QueueConfigChanged, encode_event, make_event
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def queues(*, a2_cohort: str = "alpha") -> dict:
    def q(name: str, cohort: str | None, nominal: int) -> dict:
        return {"name": name, "cohort": cohort, "teams": [f"t-{name}"], "quotas": {"H100": {"nominal": nominal}}}

    return {"priority_classes": [{"name": "normal", "value": 100}],
            "cohorts": [{"name": "alpha"}, {"name": "beta"}],
            "queues": [q("a1", "alpha", 8), q("a2", a2_cohort, 8), q("b1", "beta", 8), q("b2", "beta", 0),
                       q("solo", None, 4)]}


# (job id, team, queue, GPUs), submitted in this order, one second apart.
JOBS = [
    ("a1-1", "t-a1", "a1", 8),      # alpha: admitted within nominal
    ("a2-1", "t-a2", "a2", 8),      # alpha: admitted within nominal
    ("a1-2", "t-a1", "a1", 8),      # alpha: nothing left to borrow, waits
    ("b1-1", "t-b1", "b1", 4),      # beta: admitted
    ("b2-1", "t-b2", "b2", 4),      # beta: borrows b1's idle half
    ("b2-2", "t-b2", "b2", 4),      # beta: nothing left to borrow, waits
    ("solo-1", "t-solo", "solo", 4),  # no cohort ("-"): admitted
    ("solo-2", "t-solo", "solo", 4),  # no cohort: waits
    ("intruder", "t-a1", "b1", 1),  # beta's queue, team not allowed: rejected by beta's instance
    ("lost", "t-a1", "nope", 1),    # unknown queue: rejected once, by the instance serving "-"
]
ALPHA_SIDE = {"a1-1", "a2-1", "a1-2", "solo-1", "solo-2", "lost"}  # instance A serves alpha and "-"
BETA_SIDE = {"b1-1", "b2-1", "b2-2", "intruder"}


def submitted(job_id: str, team: str, queue: str, gpus: int, at: datetime) -> bytes:
    pods = PodSet(count=gpus // 8, gpus_per_pod=8) if gpus > 8 else PodSet(count=1, gpus_per_pod=gpus)
    spec = JobSpec(job_id=job_id, team=team, queue=queue, pod_sets=(pods,))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=at), source="test", time=at))


def completed(job_id: str) -> bytes:
    return encode_event(make_event(JobCompleted(job_id=job_id, finished_at=T0), source="test", time=T0))


async def until(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


class Env:
    """Servers, connections and started instances of one test; every instance is stopped at the end."""

    def __init__(self, nats_url: str, database_url: str) -> None:
        self.nats_url, self.database_url = nats_url, database_url
        self.runtimes: list[ServiceRuntime] = []
        self.starting: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        self.pool = await create_pool(self.database_url)
        self.conn = await asyncpg.connect(self.database_url)
        self.nc = await nats.connect(self.nats_url)
        self.js = self.nc.jetstream()

    def instance(self, name: str, cohorts: list[str] | None) -> tuple[AdmissionService, ServiceRuntime]:
        svc = AdmissionService(parse_queues(queues()), cohorts=cohorts)
        runtime = ServiceRuntime(svc.spec(), nats_url=self.nats_url, pool=self.pool, clock=ManualClock(),
                                 database_url=self.database_url, instance=name)
        self.runtimes.append(runtime)
        return svc, runtime

    async def submit_all(self) -> None:
        for i, (job_id, team, queue, gpus) in enumerate(JOBS):
            await self.js.publish(ns_subject(f"job.submitted.{team}"),
                                  submitted(job_id, team, queue, gpus, T0 + timedelta(seconds=i)))

    async def start_waiting(self, runtime: ServiceRuntime) -> asyncio.Task[None]:
        """Start an instance expected to wait for its leases; it must still be waiting a moment later."""
        task = asyncio.create_task(runtime.start())
        self.starting.append(task)
        await asyncio.sleep(1.5)
        assert not task.done(), "an instance started acting while another held its cohorts"
        return task

    async def reset(self) -> None:
        """Empty streams and an empty admission schema, as at the start of a test."""
        for runtime in self.runtimes:
            await runtime.stop()
        self.runtimes.clear()
        await delete_streams(self.js, namespace.current(), purpose="test")
        await ensure_streams(self.js, purpose="test")
        await self.conn.execute("DROP SCHEMA admission CASCADE")

    async def jobs(self) -> dict[str, tuple]:
        rows = await self.conn.fetch("SELECT job_id, status, reason, borrowing, flavors, position_in_queue, "
                                     "position_in_cohort FROM admission.jobs")
        return {r["job_id"]: tuple(r)[1:] for r in rows}

    async def settled(self, expected: int = len(JOBS)) -> dict[str, tuple]:
        """Wait until every submitted job has a row and every pending one a published reason."""
        async def done() -> bool:
            jobs = await self.jobs()
            return len(jobs) >= expected and all(row[0] != "pending" or row[1] for row in jobs.values())

        await until(done)
        return await self.jobs()

    async def emitted(self) -> list[tuple[str, str, str]]:
        """(event type, job id, emitting instance) of every event admission wrote to its outbox about jobs (not the
        versions of the queue configuration it records, nor their audit records)."""
        out = []
        for r in await self.conn.fetch("SELECT body FROM admission.outbox ORDER BY seq"):
            event = json.loads(bytes(r["body"]))
            if event["type"].endswith("config_changed.v1") or event["data"].get("action", "").startswith("config_"):
                continue
            out.append((event["type"].split(".")[3], event["data"].get("job_id", ""),
                        event["source"].rsplit("/", 1)[-1]))
        return out

    async def close(self) -> None:
        for task in self.starting:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for runtime in reversed(self.runtimes):
            await runtime.stop()
        await self.nc.close()
        await self.conn.close()
        await self.pool.close()


@pytest_asyncio.fixture
async def env(fresh: tuple[str, str]) -> AsyncIterator[Env]:
    e = Env(*fresh)
    await e.open()
    try:
        yield e
    finally:
        await e.close()


async def test_two_cohort_instances_together_decide_what_one_instance_decides(env: Env) -> None:
    # The reference: one instance for all cohorts.
    _, single = env.instance("single", None)
    await single.start()
    await env.submit_all()
    reference = await env.settled()
    statuses = {j: s for j, (s, *_rest) in reference.items()}
    assert statuses == {"a1-1": "admitted", "a2-1": "admitted", "a1-2": "pending", "b1-1": "admitted",
                        "b2-1": "admitted", "b2-2": "pending", "solo-1": "admitted", "solo-2": "pending",
                        "intruder": "rejected", "lost": "rejected"}
    assert reference["b2-1"][2] is True  # the scenario includes borrowing

    await env.reset()
    alpha, a = env.instance("A", ["alpha", "-"])
    beta, b = env.instance("B", ["beta"])
    await asyncio.gather(a.start(), b.start())  # different cohorts: neither waits for the other
    await env.submit_all()
    assert await env.settled() == reference

    # Each instance acted only for its own cohorts; the unknown-queue rejection was made once.
    emitted = await env.emitted()
    assert {(j, src) for _, j, src in emitted} == {(j, "A") for j in ALPHA_SIDE} | {(j, "B") for j in BETA_SIDE}
    rejected = sorted(j for kind, j, _ in emitted if kind == "rejected")
    assert rejected == ["intruder", "lost"]
    reasons = dict(await env.conn.fetch("SELECT job_id, reason FROM admission.jobs WHERE status = 'rejected'"))
    assert reasons == {"intruder": "Unauthorized", "lost": "UnknownQueue"}
    # Each holds only its own cohorts' jobs in memory, and saw (and ignored) the others' events.
    assert set(alpha.state.pending) | set(alpha.state.admitted) == ALPHA_SIDE - {"lost"}
    assert set(beta.state.pending) | set(beta.state.admitted) == BETA_SIDE - {"intruder"}
    assert a.counters.ignored >= len(BETA_SIDE) and b.counters.ignored >= len(ALPHA_SIDE)

    # A completion is handled by the job's instance only: it admits the next job of that cohort.
    await env.js.publish(ns_subject("job.completed"), completed("a1-1"))
    await env.js.publish(ns_subject("job.completed"), completed("b1-1"))
    await until(lambda: _statuses_are(env, {"a1-2": "admitted", "b2-2": "admitted", "a1-1": "finished",
                                            "b1-1": "finished"}))
    emitted = await env.emitted()
    assert ("admitted", "a1-2", "A") in emitted and ("admitted", "b2-2", "B") in emitted
    assert not [e for e in emitted if e[0] == "admitted" and (e[1] in ALPHA_SIDE) != (e[2] == "A")]


async def test_same_cohort_instances_lead_one_at_a_time_and_exclude_an_all_cohorts_instance(env: Env) -> None:
    _, first = env.instance("first", ["alpha"])
    second_svc, second = env.instance("second", ["alpha"])
    all_svc, everything = env.instance("all", None)
    _, beta = env.instance("beta", ["beta"])
    await first.start()
    await beta.start()  # another cohort runs beside it
    second_task = await env.start_waiting(second)
    all_task = await env.start_waiting(everything)  # per-cohort instances run: an all-cohorts one must wait

    at = T0
    await env.js.publish(ns_subject("job.submitted.t-a1"), submitted("x1", "t-a1", "a1", 8, at))
    await env.js.publish(ns_subject("job.submitted.t-b1"), submitted("y1", "t-b1", "b1", 8, at))
    await until(lambda: _statuses_are(env, {"x1": "admitted", "y1": "admitted"}))
    assert ("admitted", "x1", "first") in await env.emitted()

    # The leader stops: the standby takes over alpha with a higher term and alpha's jobs rebuilt from the tables.
    await first.stop()
    await asyncio.wait_for(second_task, timeout=15)
    assert second.lease is not None and second.lease.scope == "admission/alpha" and second.lease.term == 2
    assert set(second_svc.state.admitted) == {"x1"}
    await env.js.publish(ns_subject("job.submitted.t-a1"),
                         submitted("x2", "t-a1", "a1", 8, at + timedelta(seconds=1)))
    await env.js.publish(ns_subject("job.completed"), completed("x1"))
    await until(lambda: _statuses_are(env, {"x1": "finished", "x2": "admitted"}))
    emitted = await env.emitted()
    assert ("admitted", "x2", "second") in emitted and not [e for e in emitted if e[2] == "first" and e[1] != "x1"]
    assert not all_task.done()

    # Once no per-cohort instance runs, the all-cohorts instance takes over everything. Its consumers are new and
    # read the streams from their start: events the others handled are recognised, nothing is decided twice.
    await second.stop()
    await beta.stop()
    await asyncio.wait_for(all_task, timeout=15)
    assert set(all_svc.state.admitted) == {"x2", "y1"}
    await until(lambda: _consumed(everything, 4))
    kinds = [(kind, j) for kind, j, _ in await env.emitted()]
    assert ("rejected", "x1") not in kinds and ("rejected", "x2") not in kinds
    assert sorted(j for kind, j in kinds if kind == "admitted") == ["x1", "x2", "y1"]


async def test_queue_moving_to_another_cohort_moves_to_that_instance_with_its_jobs(env: Env) -> None:
    alpha, a = env.instance("A", ["alpha", "-"])
    beta, b = env.instance("B", ["beta"])
    await asyncio.gather(a.start(), b.start())
    await env.js.publish(ns_subject("job.submitted.t-a2"), submitted("m1", "t-a2", "a2", 8, T0))
    # 16 GPUs: more than a2 can get while m1 runs, in alpha (a1 lends 8) as in beta (b1 lends 8).
    await env.js.publish(ns_subject("job.submitted.t-a2"),
                         submitted("m2", "t-a2", "a2", 16, T0 + timedelta(seconds=1)))
    await until(lambda: _statuses_are(env, {"m1": "admitted", "m2": "pending"}))
    assert set(alpha.state.admitted) == {"m1"} and set(alpha.state.pending) == {"m2"}

    change = make_event(QueueConfigChanged(config=queues(a2_cohort="beta"), changed_by="alice"), source="test",
                        time=T0)
    await env.js.publish(ns_subject("queue.config_changed"), encode_event(change))

    async def moved() -> bool:
        return set(beta.state.admitted) == {"m1"} and set(beta.state.pending) == {"m2"} and \
            not (set(alpha.state.admitted) | set(alpha.state.pending))

    await until(moved)
    assert await env.conn.fetchval("SELECT count(*) FROM admission.config WHERE event_id = $1", change.id) == 1
    # Recorded once: the two instances started with the same file (one version) and the change is the next one.
    assert [tuple(r) for r in await env.conn.fetch(
        "SELECT version, source, event_id IS NOT NULL FROM admission.config ORDER BY version")] == [
        (1, "file", False), (2, "change", True)]
    assert await env.conn.fetchval("SELECT count(*) FROM admission.audit WHERE action = 'config_applied'") == 2
    # Both instances handled the change (each recorded it in its inbox under its own key). (The instance that did
    # not record it may have moved already on the version's publication, which it can hear first.)
    async def both_handled() -> bool:
        return await env.conn.fetchval("SELECT count(*) FROM admission.inbox WHERE event_id LIKE $1",
                                       change.id + "%") == 2

    await until(both_handled)

    # The moved queue's completion is now beta's: it frees the quota and beta admits the waiting job.
    await env.js.publish(ns_subject("job.completed"), completed("m1"))
    await until(lambda: _statuses_are(env, {"m1": "finished", "m2": "admitted"}))
    assert ("admitted", "m2", "B") in await env.emitted()
    assert set(beta.state.admitted) == {"m2"} and not alpha.state.admitted


async def _statuses_are(env: Env, expected: dict[str, str]) -> bool:
    jobs = await env.jobs()
    return all(jobs.get(j, (None,))[0] == s for j, s in expected.items())


async def _consumed(runtime: ServiceRuntime, n: int) -> bool:
    return runtime.counters.handled + runtime.counters.duplicates >= n


async def test_every_cohort_instance_applies_meterings_usage_report_to_its_queues(env: Env) -> None:
    """QueueUsageReported is broadcast: each per-cohort instance takes the report for its own queues (fair share
    over time), although only one of them would own an ordinary event."""
    from shared.events import QueueUsageReported

    doc = queues() | {"policy": {"usage_half_life_s": 86_400}}
    services = []
    for name, cohorts in (("A", ["alpha", "-"]), ("B", ["beta"])):
        svc = AdmissionService(parse_queues(doc), cohorts=cohorts)
        runtime = ServiceRuntime(svc.spec(), nats_url=env.nats_url, pool=env.pool, clock=ManualClock(),
                                 database_url=env.database_url, instance=name)
        env.runtimes.append(runtime)
        await runtime.start()
        services.append(svc)
    # a1 (alpha, nominal 8) and b2 (beta, nominal 0) used 16 GPUs on average over the last days: both borrowed
    tau = 86_400 / 0.6931471805599453
    report = QueueUsageReported(at=T0, half_life_s=86_400,
                                usage={"a1": {"H100": 16 * tau}, "b2": {"H100": 16 * tau}})
    await env.js.publish(ns_subject("queue.usage_reported"),
                         encode_event(make_event(report, source="metering", time=T0)))
    alpha, beta = services

    async def applied() -> bool:
        return alpha.state.history_share("a1") > 0 and beta.state.history_share("b2") > 0

    await until(applied)
