"""The admission service on real NATS + Postgres: a runtime quota change admits waiting work without losing any
job; an invalid change is refused, audited, and the old configuration keeps running; a restart keeps it all."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats

from services.admission.app import AdmissionService
from shared.clock import ManualClock
from shared.config import parse_queues
from shared.db import create_pool
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import (
    JobCancelRequested,
    JobCompleted,
    JobPending,
    JobPlaced,
    JobStarted,
    JobSubmitted,
    QueueConfigChanged,
    encode_event,
    make_event,
)
from shared.namespace import subject as ns_subject
from shared.service import ServiceRuntime

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def queues(nominal: int) -> dict:
    return {"priority_classes": [{"name": "normal", "value": 100}],
            "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100": {"nominal": nominal}}}]}


def submitted(job_id: str, gpus: int) -> bytes:
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))


def _runtime(nats_url: str, database_url: str, pool: asyncpg.Pool) -> ServiceRuntime:
    """A fresh admission runtime on team-a's 8 GPUs, with a manual clock."""
    return ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                          clock=ManualClock(), database_url=database_url)


async def until(check, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_runtime_config_change_and_refusal_survive_restart(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    def runtime() -> ServiceRuntime:
        return _runtime(nats_url, database_url, pool)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    svc = runtime()
    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))
        await until(lambda: _eq(status("j2"), "pending"))
        assert await status("j1") == "admitted"
        row = await conn.fetchrow("SELECT reason, message FROM admission.jobs WHERE job_id = 'j2'")
        assert row["reason"] == "WaitingForQuota" and "8/8" in row["message"]

        bad = queues(16)
        bad["queues"][0]["quotas"]["H100"]["nominal"] = -1
        for doc in (bad, queues(16)):
            await js.publish(ns_subject("queue.config_changed"), encode_event(make_event(
                QueueConfigChanged(config=doc, changed_by="alice"), source="test", time=T0)))
        await until(lambda: _eq(status("j2"), "admitted"))
        actions = [(r["action"], r["source"]) for r in await conn.fetch(
            "SELECT action, detail->>'source' AS source FROM admission.audit ORDER BY id")]
        assert actions == [("config_applied", "file"), ("config_refused", None), ("config_applied", "change")]
        refused = await conn.fetchval("SELECT detail->>'error' FROM admission.audit WHERE action = 'config_refused'")
        assert "queues[0].quotas.H100.nominal" in refused
    finally:
        await svc.stop()

    # Restart: the applied configuration (16 GPUs) is the one in force, and nothing was lost.
    svc = runtime()
    await svc.start()
    try:
        await js.publish(ns_subject("job.submitted.team-a"), submitted("j3", 8))
        await until(lambda: _eq(status("j3"), "pending"))
        assert {r["job_id"]: r["status"] for r in await conn.fetch("SELECT job_id, status FROM admission.jobs")} == {
            "j1": "admitted", "j2": "admitted", "j3": "pending"}
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _eq(value, expected) -> bool:  # type: ignore[no-untyped-def]
    return (await value) == expected


async def test_small_position_moves_deep_in_a_queue_update_the_table_but_publish_no_event(
        fresh: tuple[str, str]) -> None:
    """An admission at the head moves every waiting job up one place: the table follows every move (gpuq explain),
    JobPending events only go to the jobs that reach the first ten places."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(4))).spec(), nats_url=nats_url, pool=pool,
                         clock=ManualClock(), database_url=database_url)
    jobs = [f"j{i:02d}" for i in range(30)]  # one submit time: queue order is job id order

    async def positions() -> dict[str, int]:
        rows = await conn.fetch("SELECT job_id, position_in_queue FROM admission.jobs WHERE status = 'pending'")
        return {r["job_id"]: r["position_in_queue"] for r in rows}

    async def pending_events() -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in await conn.fetch("SELECT body FROM admission.outbox"):
            event = json.loads(bytes(r["body"]))
            if event["type"] == JobPending.event_type():
                job_id = event["data"]["job_id"]
                counts[job_id] = counts.get(job_id, 0) + 1
        return counts

    await svc.start()
    try:
        for job_id in jobs:
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 1))

        async def all_waiting() -> bool:
            got = await positions()
            return len(got) == 26 and all(got.values())

        await until(all_waiting)
        assert (await positions())["j29"] == 26
        before = await pending_events()
        assert all(before.get(j, 0) >= 1 for j in jobs[4:])  # every waiting job heard why once

        done = JobCompleted(job_id="j00", finished_at=T0)
        await js.publish(ns_subject("job.completed"), encode_event(make_event(done, source="test", time=T0)))
        await until(lambda: _eq(status_of(conn, "j04"), "admitted"))
        await until(lambda: _eq(_position(conn, "j29"), 25))
        after = await pending_events()
        moved_into_top_ten = {f"j{i:02d}" for i in range(5, 15)}  # positions 2..11 -> 1..10
        for job_id in jobs[5:]:
            new = after.get(job_id, 0) - before.get(job_id, 0)
            assert new == (1 if job_id in moved_into_top_ten else 0), (job_id, new)
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def status_of(conn: asyncpg.Connection, job_id: str) -> str | None:
    return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)


async def _position(conn: asyncpg.Connection, job_id: str) -> int | None:
    return await conn.fetchval("SELECT position_in_queue FROM admission.jobs WHERE job_id = $1", job_id)


def tree_queues(cycle: bool = False) -> dict:
    """team-a in cohort vision, an idle lender in the sibling cohort speech, both under org (or a cycle)."""
    cohorts = [{"name": "org", "parent": "speech" if cycle else None},
               {"name": "vision", "parent": "org"}, {"name": "speech", "parent": "org"}]
    return {"priority_classes": [{"name": "normal", "value": 100}], "cohorts": cohorts,
            "queues": [{"name": "team-a", "teams": ["team-a"], "cohort": "vision", "quotas": {"H100": {"nominal": 8}}},
                       {"name": "lender", "cohort": "speech", "quotas": {"H100": {"nominal": 8}}}]}


async def test_a_cohort_tree_applied_at_runtime_lets_a_queue_borrow_from_a_sibling_cohort(
        fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    svc = ServiceRuntime(AdmissionService(parse_queues(queues(8))).spec(), nats_url=nats_url, pool=pool,
                         clock=ManualClock(), database_url=database_url)

    async def status(job_id: str) -> str | None:
        return await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = $1", job_id)

    await svc.start()
    try:
        for job_id in ("j1", "j2"):
            await js.publish(ns_subject("job.submitted.team-a"), submitted(job_id, 8))
        await until(lambda: _eq(status("j2"), "pending"))
        for doc in (tree_queues(cycle=True), tree_queues()):
            await js.publish(ns_subject("queue.config_changed"), encode_event(make_event(
                QueueConfigChanged(config=doc, changed_by="alice"), source="test", time=T0)))
        await until(lambda: _eq(status("j2"), "admitted"))  # 8 of its own, 8 lent by speech through org
        refused = await conn.fetchval("SELECT detail->>'error' FROM admission.audit WHERE action = 'config_refused'")
        assert "cohort parents form a cycle" in refused
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_one_batch_of_submissions_a_duplicate_and_a_cancel_keeps_every_verdict(fresh: tuple[str, str]) -> None:
    """Queued submissions' rows are written at the batch's end (services/admission/held.py): a duplicate later in
    the same pull is still refused, and a cancel later in it still finds the job."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    def runtime() -> ServiceRuntime:
        return _runtime(nats_url, database_url, pool)

    svc = runtime()
    await svc.start()  # streams and consumers exist; stopped, so that everything below arrives in one pull
    await svc.stop()
    cancel = encode_event(make_event(JobCancelRequested(job_id="b2", requested_by="bob"), source="test", time=T0))
    for subject, body in (("job.submitted.team-a", submitted("b1", 4)), ("job.submitted.team-a", submitted("b2", 8)),
                          ("job.submitted.team-a", submitted("b1", 2)), ("job.cancel_requested.team-a", cancel),
                          ("job.submitted.team-a", submitted("b3", 4))):
        await js.publish(ns_subject(subject), body)
    svc = runtime()
    await svc.start()
    try:
        async def settled() -> bool:
            return await conn.fetchval("SELECT count(*) FROM admission.submissions") == 4 and \
                await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'b3'") == "admitted"

        await until(settled)
        jobs = {r["job_id"]: (r["status"], r["outcome"]) for r in
                await conn.fetch("SELECT job_id, status, outcome FROM admission.jobs")}
        assert jobs == {"b1": ("admitted", None), "b2": ("finished", "Cancelled"), "b3": ("admitted", None)}
        verdicts = sorted((r["job_id"], r["verdict"], r["reason"]) for r in
                          await conn.fetch("SELECT job_id, verdict, reason FROM admission.submissions"))
        assert verdicts == [("b1", "queued", None), ("b1", "rejected", "DuplicateJobId"), ("b2", "queued", None),
                            ("b3", "queued", None)]
        assert svc.counters.batches >= 1 and svc.counters.batch_retries == 0
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_batchs_submissions_read_in_one_statement_give_the_verdicts_read_one_by_one(
        fresh: tuple[str, str]) -> None:
    """A batch's submission lookups are read at its start in one statement (services/admission/prefetch.py). Rows and
    tombstones from earlier batches count; a cancel earlier in the same batch, and a second submission of an id,
    are still seen (those jobs ask Postgres themselves); the verdicts are those of one-by-one handling."""
    nats_url, database_url = fresh

    def cancel(job_id: str) -> bytes:
        return encode_event(make_event(JobCancelRequested(job_id=job_id, requested_by="bob"), source="test", time=T0))

    async with _connected(nats_url, database_url) as (pool, conn, js):
        svc = _runtime(nats_url, database_url, pool)
        await svc.start()
        try:  # an earlier batch: e1 admitted, a cancel for t1 before t1 exists (a tombstone)
            await _one_pull(js, [("job.submitted.team-a", submitted("e1", 2)),
                                 ("job.cancel_requested.team-a", cancel("t1"))])
            await until(lambda: _eq(conn.fetchval("SELECT count(*) FROM admission.tombstones"), 1))
            await until(lambda: _eq(conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'e1'"),
                                    "admitted"))
        finally:
            await svc.stop()
        await _one_pull(js, [("job.submitted.team-a", submitted("e1", 2)),  # taken in an earlier batch
                             ("job.submitted.team-a", submitted("t1", 2)),  # its tombstone came in an earlier batch
                             ("job.cancel_requested.team-a", cancel("n2")),  # a tombstone in this batch ...
                             ("job.submitted.team-a", submitted("n2", 2)),  # ... that this one must still find
                             ("job.submitted.team-a", submitted("n3", 2)),
                             ("job.submitted.team-a", submitted("n3", 2))])  # taken earlier in this batch
        svc = _runtime(nats_url, database_url, pool)
        await svc.start()
        try:
            await until(lambda: _eq(conn.fetchval("SELECT count(*) FROM admission.submissions"), 6))
            jobs = {r["job_id"]: (r["status"], r["outcome"]) for r in
                    await conn.fetch("SELECT job_id, status, outcome FROM admission.jobs")}
            assert jobs == {"e1": ("admitted", None), "t1": ("finished", "Cancelled"),
                            "n2": ("finished", "Cancelled"), "n3": ("admitted", None)}
            verdicts = sorted((r["job_id"], r["verdict"], r["reason"]) for r in
                              await conn.fetch("SELECT job_id, verdict, reason FROM admission.submissions"))
            assert verdicts == [("e1", "queued", None), ("e1", "rejected", "DuplicateJobId"),
                                ("n2", "cancelled", "Cancelled"), ("n3", "queued", None),
                                ("n3", "rejected", "DuplicateJobId"), ("t1", "cancelled", "Cancelled")]
            assert await conn.fetchval("SELECT count(*) FROM admission.tombstones") == 0
            assert svc.counters.batches >= 1 and svc.counters.batch_retries == 0
        finally:
            await svc.stop()


@contextlib.asynccontextmanager
async def _connected(nats_url: str, database_url: str) -> AsyncIterator[tuple[asyncpg.Pool, asyncpg.Connection, Any]]:
    """A pool and a connection to Postgres and a JetStream context, closed afterwards."""
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    try:
        yield pool, conn, nc.jetstream()
    finally:
        await nc.close()
        await conn.close()
        await pool.close()


def _spec(job_id: str, gpus: int) -> JobSpec:
    return JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(count=1, gpus_per_pod=gpus),))


def _placed(job_id: str, gpus: int, node: str) -> bytes:
    return encode_event(make_event(JobPlaced(
        job_id=job_id, spec=_spec(job_id, gpus), placed_at=T0,
        bindings=(GpuBinding(pod="main-0", node=node, gpu_indices=tuple(range(gpus))),)), source="test", time=T0))


def _started(job_id: str, at: float) -> bytes:
    return encode_event(make_event(JobStarted(job_id=job_id, started_at=datetime.fromtimestamp(at, UTC)),
                                   source="test", time=T0))


def _completed(job_id: str) -> bytes:
    return encode_event(make_event(JobCompleted(job_id=job_id, finished_at=T0), source="test", time=T0))


async def _one_pull(js: object, messages: list[tuple[str, bytes]]) -> None:
    for subject, body in messages:
        await js.publish(ns_subject(subject), body)  # type: ignore[attr-defined]


async def _admitted_pair(nats_url: str, database_url: str, pool: asyncpg.Pool, conn: asyncpg.Connection,
                         js: object) -> AdmissionService:
    """j1 and j2 admitted (4 GPUs each), then the service stopped so that what follows arrives in one pull."""
    service = AdmissionService(parse_queues(queues(8)))
    svc = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=ManualClock(), database_url=database_url)
    await svc.start()
    try:
        await _one_pull(js, [("job.submitted.team-a", submitted(job_id, 4)) for job_id in ("j1", "j2")])
        await until(lambda: _eq(conn.fetchval("SELECT count(*) FROM admission.jobs WHERE status = 'admitted'"), 2))
    finally:
        await svc.stop()
    return service


async def test_one_batch_of_placements_starts_and_ends_writes_every_row_as_one_by_one(fresh: tuple[str, str]) -> None:
    """A batch's JobPlaced/JobStarted/JobCompleted updates are held for its end (services/admission/held.py): each row
    ends as if each message had written it at once, a placement of a job admission does not hold changes nothing,
    and a duplicate submission of a job that ended earlier in the same pull is refused with its ended status."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await _admitted_pair(nats_url, database_url, pool, conn, js)
        start = T0.timestamp() + 5
        await _one_pull(js, [("job.placed", _placed("j1", 4, "n1")), ("job.placed", _placed("j2", 4, "n2")),
                             ("job.placed", _placed("ghost", 1, "n3")), ("job.started", _started("j1", start)),
                             ("job.started", _started("j2", start + 1)), ("job.completed", _completed("j2")),
                             ("job.submitted.team-a", submitted("j2", 4)),
                             ("job.submitted.team-a", submitted("j3", 4))])
        service = AdmissionService(parse_queues(queues(8)))
        svc = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url)
        await svc.start()
        try:
            await until(lambda: _eq(conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'j3'"),
                                    "admitted"))
            rows = {r["job_id"]: r for r in await conn.fetch(
                "SELECT job_id, status, outcome, bindings->0->>'node' AS node, started_at, expected_end "
                "FROM admission.jobs")}
            assert set(rows) == {"j1", "j2", "j3"}  # no row for the placement of a job admission never held
            assert (rows["j1"]["status"], rows["j1"]["node"], rows["j1"]["started_at"]) == ("admitted", "n1", start)
            assert rows["j1"]["expected_end"] == start + _spec("j1", 4).max_runtime_s
            assert service.expected_end["j1"] == rows["j1"]["expected_end"]  # memory and row agree
            # placed, started and finished in one pull: finished, its placement and start kept
            assert (rows["j2"]["status"], rows["j2"]["outcome"], rows["j2"]["node"], rows["j2"]["started_at"]) == (
                "finished", "Succeeded", "n2", start + 1)
            assert "j2" not in service.expected_end
            refused = await conn.fetchval(
                "SELECT message FROM admission.submissions WHERE job_id = 'j2' AND verdict = 'rejected'")
            assert refused == "job id j2 was already submitted (finished)"
            assert svc.counters.batches >= 1 and svc.counters.batch_retries == 0
        finally:
            await svc.stop()
    finally:
        await nc.close()
        await conn.close()
        await pool.close()


async def test_a_batch_failing_at_its_end_loses_and_duplicates_no_held_update(fresh: tuple[str, str]) -> None:
    """The batch's end fails after its held updates were written (as a crash before the commit would): the
    transaction rolls back with them, the messages are handled again one by one, and every row and event comes out
    once, as without the failure."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await _admitted_pair(nats_url, database_url, pool, conn, js)
        start = T0.timestamp() + 5
        await _one_pull(js, [("job.placed", _placed("j1", 4, "n1")), ("job.started", _started("j1", start)),
                             ("job.completed", _completed("j2")), ("job.submitted.team-a", submitted("j3", 4))])
        service = AdmissionService(parse_queues(queues(8)))
        cycle = service.cycle
        failed: list[object] = []

        async def failing_once(tx):  # type: ignore[no-untyped-def]
            if not failed:
                bindings = await tx.conn.fetchval("SELECT bindings FROM admission.jobs WHERE job_id = 'j1'")
                failed.append(bindings)  # the held update was written before the cycle ran
                raise RuntimeError("the batch's end fails")
            await cycle(tx)

        service.cycle = failing_once  # type: ignore[method-assign]
        svc = ServiceRuntime(service.spec(), nats_url=nats_url, pool=pool, clock=ManualClock(),
                             database_url=database_url)
        await svc.start()
        try:
            await until(lambda: _eq(conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'j3'"),
                                    "admitted"))
            assert failed and failed[0] is not None
            rows = {r["job_id"]: (r["status"], r["outcome"], r["node"], r["started_at"]) for r in await conn.fetch(
                "SELECT job_id, status, outcome, bindings->0->>'node' AS node, started_at FROM admission.jobs")}
            assert rows == {"j1": ("admitted", None, "n1", start), "j2": ("finished", "Succeeded", None, None),
                            "j3": ("admitted", None, None, None)}
            assert service.expected_end == {"j1": start + _spec("j1", 4).max_runtime_s}
            admitted = await conn.fetchval("SELECT count(*) FROM admission.outbox WHERE subject LIKE '%job.admitted%'")
            assert admitted == 3  # j1, j2 before the pull, j3 once
            # (the job events; admission also hears its own publications of the configuration's version at start)
            assert await conn.fetchval(
                "SELECT count(*) FROM admission.inbox WHERE type NOT LIKE '%config_changed%'") == 6
        finally:
            await svc.stop()
    finally:
        await nc.close()
        await conn.close()
        await pool.close()


def capped_queues() -> dict:
    """`capped` (2 GPUs, may not borrow) and `open` (8 GPUs) in one cohort."""
    return {"priority_classes": [{"name": "normal", "value": 100}], "cohorts": [{"name": "c"}],
            "queues": [{"name": "capped", "teams": ["capped"], "cohort": "c",
                        "quotas": {"H100": {"nominal": 2, "borrowing_limit": 0}}},
                       {"name": "open", "teams": ["open"], "cohort": "c", "quotas": {"H100": {"nominal": 8}}}]}


def submitted_to(queue: str, job_id: str) -> bytes:
    spec = JobSpec(job_id=job_id, team=queue, queue=queue, pod_sets=(PodSet(count=1, gpus_per_pod=1),))
    return encode_event(make_event(JobSubmitted(spec=spec, submitted_at=T0), source="test", time=T0))


async def test_a_capped_queues_backlog_keeps_its_rows_and_gets_the_cohorts_numbers_once_a_minute(
        fresh: tuple[str, str]) -> None:
    """A queue at its hard cap is not judged again while the rest of its cohort changes (core/cycle.py, sealed
    queues): its waiting jobs' rows keep their reasons and positions, and the cohort's lendable count in their
    messages is rewritten once MESSAGE_EVERY_S has passed, as for any message whose only news is its numbers."""
    nats_url, database_url = fresh
    pool = await create_pool(database_url)
    conn = await asyncpg.connect(database_url)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    clock = ManualClock()
    svc = ServiceRuntime(AdmissionService(parse_queues(capped_queues())).spec(), nats_url=nats_url, pool=pool,
                         clock=clock, database_url=database_url)

    async def rows() -> dict[str, tuple[str, str, int]]:
        got = await conn.fetch("SELECT job_id, reason, message, position_in_queue FROM admission.jobs "
                               "WHERE queue = 'capped' AND status = 'pending' ORDER BY job_id")
        return {r["job_id"]: (r["reason"], r["message"], r["position_in_queue"]) for r in got}

    async def admitted(job_id: str) -> bool:
        return await status_of(conn, job_id) == "admitted"

    await svc.start()
    try:
        for i in range(6):
            await js.publish(ns_subject("job.submitted.capped"), submitted_to("capped", f"c{i}"))
        await until(lambda: _eq(_count(rows()), 4))
        first = await rows()
        assert [p for _, _, p in first.values()] == [1, 2, 3, 4]
        assert all(m.endswith("cohort c has 8 lendable") for _, m, _ in first.values()), first
        for i in range(3):  # the cohort changes around the capped queue, one event (one cycle) at a time
            await js.publish(ns_subject("job.submitted.open"), submitted_to("open", f"o{i}"))
            await until(lambda i=i: admitted(f"o{i}"))  # type: ignore[misc]
        assert await rows() == first  # within the minute: reasons, positions and the old numbers stay
        clock.advance(61)
        await js.publish(ns_subject("job.submitted.open"), submitted_to("open", "o3"))
        await until(lambda: admitted("o3"))

        async def renumbered() -> bool:
            return all(m.endswith("cohort c has 4 lendable") for _, m, _ in (await rows()).values())

        await until(renumbered)
        assert {j: (r, p) for j, (r, _, p) in (await rows()).items()} == {j: (r, p) for j, (r, _, p) in first.items()}
    finally:
        await svc.stop()
        await nc.close()
        await conn.close()
        await pool.close()


async def _count(rows: Any) -> int:  # type: ignore[no-untyped-def]
    return len(await rows)
