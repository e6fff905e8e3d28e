"""The ledger on a real Postgres, fed through the service's handlers."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.metering import store
from services.metering.handlers import HANDLERS
from services.metering.testing import QUEUES_DOC, T0_MS, at, deliver, event, placed, sampled, scenario, spec
from services.scheduler.nodes import record_node
from shared.domain import GpuBinding, NodeSpec
from shared.events import (
    GpuSample,
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobResized,
    JobStarted,
    QueueConfigChanged,
    UtilizationSampled,
    make_event,
)
from shared.service import Tx

pytestmark = pytest.mark.asyncio(loop_scope="session")
H = 3600


async def snapshot(pool: asyncpg.Pool) -> dict[str, Any]:
    async with pool.acquire() as conn:
        return {
            "summary": await store.team_summary(conn),
            "allocations": [tuple(r) for r in await conn.fetch(
                "SELECT * FROM metering.allocations ORDER BY job_id, placed_at, node")],
            "usage": [tuple(r) for r in await conn.fetch(
                "SELECT * FROM metering.usage_hourly ORDER BY job_id, node, hour")],
            "jobs": [tuple(r) for r in await conn.fetch("SELECT * FROM metering.jobs ORDER BY job_id")],
        }


async def test_lifecycle_ledger_figures(pool):
    await deliver(pool, scenario())
    snap = await snapshot(pool)
    assert snap["summary"] == [
        {"team": "team-a", "jobs": 1, "allocated_gpu_hours": 16.0, "used_gpu_hours": 8.0, "idle_gpu_hours": 8.0,
         "lost_gpu_hours": 0.0, "cost": 64.0},
        {"team": "team-b", "jobs": 1, "allocated_gpu_hours": 8.0, "used_gpu_hours": 0.0, "idle_gpu_hours": 8.0,
         "lost_gpu_hours": 0.25, "cost": 32.0},
    ]
    async with pool.acquire() as conn:
        ledger = await store.load_ledger(conn)
        energy = await conn.fetchval("SELECT sum(energy_mj) FROM metering.usage_hourly")
        ends = await conn.fetch("SELECT node, end_kind, lost_ms, started_at FROM metering.allocations "
                                "WHERE job_id = 'b-train' ORDER BY placed_at")
    assert energy == 16 * 400 * H * 1000  # 16 GPUs at 400 W for an hour = 6.4 kWh
    assert [(r["node"], r["end_kind"], r["lost_ms"]) for r in ends] == [
        ("h-2", "preempted", 900_000), ("h-3", "completed", 0)]
    assert ledger.dims["a-train"].labels == (("feature", "search"), ("project", "p1"))
    assert ledger.horizon_ms == T0_MS + 4200 * 1000


async def test_replayed_twice_and_shuffled_gives_identical_totals(pool, metering_db_url):
    events = scenario()
    await deliver(pool, events)
    first = await snapshot(pool)

    # Same ledger, built again from scratch from the stream delivered twice, in a random order.
    async with pool.acquire() as conn:
        await conn.execute("TRUNCATE metering.jobs, metering.job_facts, metering.allocations, "
                           "metering.gpu_samples, metering.usage_hourly, metering.rates")
    replay = events + events
    random.Random(7).shuffle(replay)
    await deliver(pool, replay)
    assert await snapshot(pool) == first

    # And the whole stream once more on top (a consumer reset): nothing changes.
    shuffled = list(events)
    random.Random(11).shuffle(shuffled)
    await deliver(pool, shuffled)
    assert await snapshot(pool) == first


async def test_samples_before_placement_still_count(pool):
    job = spec("early", team="team-a", gpus=8)
    await deliver(pool, [event(sampled("h-9", 60, "early", [100.0] * 8), 60)])
    async with pool.acquire() as conn:
        before = await store.team_summary(conn)
    assert before == [{"team": "(unknown)", "jobs": 1, "allocated_gpu_hours": 0.0, "used_gpu_hours": 0.1333,
                       "idle_gpu_hours": 0.0, "lost_gpu_hours": 0.0, "cost": 0.0}]
    await deliver(pool, [event(placed(job, 0, ["h-9"]), 0), event(JobFailed(job_id="early", finished_at=at(60)), 60)])
    async with pool.acquire() as conn:
        after = await store.team_summary(conn)
    assert after == [{"team": "team-a", "jobs": 1, "allocated_gpu_hours": 0.1333, "used_gpu_hours": 0.1333,
                      "idle_gpu_hours": 0.0, "lost_gpu_hours": 0.0, "cost": 0.13}]


async def test_open_allocation_runs_to_the_ledger_horizon_and_model_from_inventory(pool):
    node = NodeSpec(name="a100-0", gpus=8, gpu_model="A100-40GB", cpu_milli=1, memory_mib=1, rack="r", block="b")
    job = spec("open", team="team-b", gpus=8, model=None)
    async with pool.acquire() as conn:  # the scheduler records the inventory; metering reads its read model
        await record_node(conn, node, at=0.0)
    await deliver(pool, [event(QueueConfigChanged(config=QUEUES_DOC)),
                         event(placed(job, 0, ["a100-0"]), 0),
                         event(sampled("a100-0", 1800, "open", [0.0] * 8, model=None, interval_s=1800), 1800)])
    async with pool.acquire() as conn:
        table = await store.team_summary(conn)
        ledger = await store.load_ledger(conn)
    assert {a.gpu_model for a in ledger.allocations} == {"A100-40GB"}
    assert table == [{"team": "team-b", "jobs": 1, "allocated_gpu_hours": 4.0, "used_gpu_hours": 0.0,
                      "idle_gpu_hours": 4.0, "lost_gpu_hours": 0.0, "cost": 8.0}]


async def test_an_older_price_list_does_not_replace_a_newer_one(pool):
    newer = dict(QUEUES_DOC, gpu_flavors={"H100-80GB": {"cost_per_gpu_hour": 5.0}})
    await deliver(pool, [make_event(QueueConfigChanged(config=newer), source="t", time=at(100)),
                         make_event(QueueConfigChanged(config=QUEUES_DOC), source="t", time=at(50)),
                         make_event(QueueConfigChanged(config={"queues": "not a list"}), source="t", time=at(200))])
    async with pool.acquire() as conn:
        assert await store.load_rates(conn) == {"H100-80GB": 5.0}


async def test_batched_samples_count_once_and_prune_keeps_rollups(pool):
    batch = [sampled(f"n{i}", 60 * k, "j", [float(k)] * 4) for i in range(3) for k in range(1, 5)]
    async with pool.acquire() as conn:
        assert await store.record_samples(conn, batch) == 48
        assert await store.record_samples(conn, batch[::-1] + batch) == 0
        assert await conn.fetchval("SELECT sum(used_gpu_ms) FROM metering.usage_hourly") == 3 * 4 * 600 * 10
        assert await store.prune_samples(conn, datetime(2030, 1, 1, tzinfo=UTC)) == 48
        assert await conn.fetchval("SELECT sum(samples) FROM metering.usage_hourly") == 48



async def test_mig_instances_are_separate_samples_charged_their_slice(pool):
    """dcgm-exporter samples each MIG instance: two jobs on one GPU are two samples at the same instant, each
    counting its slice's share of a GPU in used and sampled time; delivering them again counts nothing twice."""
    bindings = {"nb-a": (0, 0), "nb-b": (0, 3)}
    events = [event(JobPlaced(job_id=j, spec=spec(j, mig_profile="3g.40gb", model="A100-80GB"), placed_at=at(0),
                              bindings=(GpuBinding(pod="main-0", node="m-0", mig_slice=s),)))
              for j, s in bindings.items()]
    for t in range(60, 3601, 60):
        events.append(event(UtilizationSampled(node="m-0", gpu_model="A100-80GB", sampled_at=at(t), interval_s=60,
                                               source="dcgm", samples=(
            GpuSample(job_id="nb-a", gpu_index=0, gpu_instance=1, mig_profile="3g.40gb", utilization_pct=100,
                      power_w=100),
            GpuSample(job_id="nb-b", gpu_index=0, gpu_instance=2, mig_profile="3g.40gb", utilization_pct=50,
                      power_w=100))), t))
    await deliver(pool, events)
    await deliver(pool, events[2:])  # again: the ledger's own deduplication, without the runtime's inbox
    async with pool.acquire() as conn:
        rows = {r["job_id"]: r for r in await conn.fetch(
            "SELECT job_id, sum(used_gpu_ms) AS used, sum(sampled_gpu_ms) AS sampled, sum(samples) AS n "
            "FROM metering.usage_hourly GROUP BY job_id")}
        summary = {r["team"]: r for r in await store.team_summary(conn)}
    assert rows["nb-a"]["n"] == rows["nb-b"]["n"] == 60
    assert rows["nb-a"]["used"] == 60 * 60_000 * 428 // 1000  # 3g = 428 milli-GPUs, at 100 %
    assert rows["nb-b"]["used"] == 60 * 60_000 * 428 // 1000 // 2
    assert rows["nb-a"]["sampled"] == rows["nb-b"]["sampled"] == 60 * 60_000 * 428 // 1000
    # Allocated and used are both in slices: a slice busy all hour is not idle, however small it is.
    assert summary["team-a"]["allocated_gpu_hours"] == pytest.approx(2 * 0.428)
    assert summary["team-a"]["used_gpu_hours"] == pytest.approx(0.428 * 1.5)
    assert summary["team-a"]["idle_gpu_hours"] == pytest.approx(0.428 * 0.5)


async def test_node_models_come_from_the_scheduler_then_from_samples(pool):
    """GPU models are the scheduler's node facts, read when a report is made: a node it removed since still
    charges its past allocation at its model; a node it never announced takes the model its samples named."""
    gone = NodeSpec(name="l4-0", gpus=8, gpu_model="L4", cpu_milli=1, memory_mib=1, rack="r", block="b")
    async with pool.acquire() as conn:
        await record_node(conn, gone, at=0.0)
        await record_node(conn, gone, at=10.0, removed=True)
    on_gone, on_unknown = spec("on-gone", team="team-a", gpus=8, model=None), spec("on-dcgm", team="team-b", gpus=8,
                                                                                  model=None)
    await deliver(pool, [event(placed(on_gone, 0, ["l4-0"]), 0), event(placed(on_unknown, 0, ["dcgm-0"]), 0),
                         event(sampled("dcgm-0", 60, "on-dcgm", [10.0] * 8, model="A10"), 60),
                         event(JobFailed(job_id="on-gone", finished_at=at(60)), 60),
                         event(JobFailed(job_id="on-dcgm", finished_at=at(60)), 60)])
    async with pool.acquire() as conn:
        ledger = await store.load_ledger(conn)
    assert sorted((a.job_id, a.gpu_model) for a in ledger.allocations) == [("on-dcgm", "A10"), ("on-gone", "L4")]
    assert [(u.job_id, u.gpu_model) for u in ledger.usage] == [("on-dcgm", "A10")]
    # The scheduler's fact outranks what a sample said.
    async with pool.acquire() as conn:
        await record_node(conn, gone.model_copy(update={"name": "dcgm-0", "gpu_model": "A10G"}), at=20.0)
        ledger = await store.load_ledger(conn)
    assert sorted((a.job_id, a.gpu_model) for a in ledger.allocations) == [("on-dcgm", "A10G"), ("on-gone", "L4")]
    async with pool.acquire() as conn:  # fair share over time decays the same allocations under the same models
        usage = await store.decayed_usage(conn, at(3600), 3600.0)
    assert {q: sorted(m) for q, m in usage.items()} == {"team-a": ["L4"], "team-b": ["A10G"]}


async def test_one_batch_of_every_event_gives_the_ledger_of_one_transaction_each(pool):
    """In a consumed batch (the runtime's Tx with deferred work), facts are written per message and each job's
    allocations rebuilt once at the batch's end, for every job at once: the same ledger as one event per
    transaction, and a rebuilt job whose fact came twice is unchanged."""
    events = scenario()
    await deliver(pool, events)
    first = await snapshot(pool)
    async with pool.acquire() as conn:
        await conn.execute("TRUNCATE metering.jobs, metering.job_facts, metering.allocations, "
                           "metering.gpu_samples, metering.usage_hourly, metering.rates")
    async with pool.acquire() as conn, conn.transaction():
        deferred: dict[str, Any] = {}
        scratch: dict[str, Any] = {}
        for ev in events + events[:5]:
            payload = ev.payload()
            tx = Tx(conn=conn, now=0.0, source="test", schema="metering", deferred=deferred, scratch=scratch)
            await HANDLERS[type(payload)](tx, ev, payload)
        assert await conn.fetchval("SELECT count(*) FROM metering.allocations") == 0  # not rebuilt yet
        assert list(deferred) == ["metering-allocations"]
        end = Tx(conn=conn, now=0.0, source="test", schema="metering", scratch=scratch)
        for work in deferred.values():
            await work(end)
    assert await snapshot(pool) == first


async def test_held_facts_are_written_at_the_batch_end_and_lost_with_its_rollback_only(pool):
    """A batch handled without savepoints holds its facts for its end (a few statements for all); one handled with
    a savepoint per message writes each at once (its savepoint could roll back alone). A crash before the commit of
    a batch that held facts leaves none of them, and the batch handled again gives the ledger of one delivery."""
    events = scenario()
    await deliver(pool, events)
    once = await snapshot(pool)
    tables = ("TRUNCATE metering.jobs, metering.job_facts, metering.allocations, metering.gpu_samples, "
              "metering.usage_hourly, metering.rates")
    async with pool.acquire() as conn:
        await conn.execute(tables)

    async def batch(conn: asyncpg.Connection, *, own_savepoint: bool) -> int:
        """Handle every event as one batch; returns the facts written before the batch's end."""
        deferred: dict[str, Any] = {}
        scratch: dict[str, Any] = {}
        for ev in events:
            payload = ev.payload()
            tx = Tx(conn=conn, now=0.0, source="test", schema="metering", deferred=deferred, scratch=scratch,
                    own_savepoint=own_savepoint)
            await HANDLERS[type(payload)](tx, ev, payload)
        before_end = int(await conn.fetchval("SELECT count(*) FROM metering.job_facts"))
        end = Tx(conn=conn, now=0.0, source="test", schema="metering", scratch=scratch)
        for work in deferred.values():
            await work(end)
        assert not scratch.get("metering-held-facts")
        return before_end

    class Crash(Exception):
        pass

    with pytest.raises(Crash):
        async with pool.acquire() as conn, conn.transaction():
            assert await batch(conn, own_savepoint=False) == 0  # held for the end
            assert await conn.fetchval("SELECT count(*) FROM metering.job_facts") > 0
            raise Crash  # before the commit
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM metering.job_facts") == 0  # nothing charged
    async with pool.acquire() as conn, conn.transaction():
        await batch(conn, own_savepoint=False)
    assert await snapshot(pool) == once
    async with pool.acquire() as conn, conn.transaction():  # delivered again: no fact twice
        await batch(conn, own_savepoint=False)
    assert await snapshot(pool) == once

    async with pool.acquire() as conn:
        await conn.execute(tables)
    async with pool.acquire() as conn, conn.transaction():
        assert await batch(conn, own_savepoint=True) == 8  # all 8 facts, each at once
    assert await snapshot(pool) == once


async def test_a_resized_elastic_job_is_charged_the_pods_it_runs_with(pool):
    """Issue 48: an elastic job started on 1 node (8 GPUs), grown to 2 nodes after 30 minutes (JobResized), shrunk
    back to 1 after another 30 and completed 30 later is charged 8 + 16 + 8 = 32 GPU-hours x 0.5 h = 16 GPU-hours,
    in the ledger on Postgres, however often the resize is delivered (without the resize fact: 12)."""
    job = spec("e-train", team="team-a", gpus=16, pods=2)
    grown = placed(job, 1800, ["h-0", "h-1"])
    shrunk = placed(job, 3600, ["h-0"])
    evs = [event(QueueConfigChanged(config=QUEUES_DOC), -60),
           event(placed(job, 0, ["h-0"]), 0), event(JobStarted(job_id="e-train", started_at=at(10)), 10),
           event(JobResized(job_id="e-train", spec=job, bindings=grown.bindings, pods_before=1, pods=2,
                            reason="Grow"), 1800),
           event(JobResized(job_id="e-train", spec=job, bindings=shrunk.bindings, pods_before=2, pods=1,
                            reason="Shrink", for_job="other"), 3600),
           event(JobCompleted(job_id="e-train", finished_at=at(5400)), 5400)]
    await deliver(pool, evs + evs[2:4])  # a redelivered start and grow change nothing
    snap = await snapshot(pool)
    row = next(r for r in snap["summary"] if r["team"] == "team-a")
    assert (row["allocated_gpu_hours"], row["cost"]) == (16.0, 64.0)
    async with pool.acquire() as conn:
        parts = await conn.fetch("SELECT node, milli_gpus, end_kind FROM metering.allocations "
                                 "WHERE job_id = 'e-train' ORDER BY placed_at, node")
    assert [(r["node"], r["milli_gpus"], r["end_kind"]) for r in parts] == [
        ("h-0", 8000, "resized"), ("h-0", 8000, "resized"), ("h-1", 8000, "resized"), ("h-0", 8000, "completed")]
