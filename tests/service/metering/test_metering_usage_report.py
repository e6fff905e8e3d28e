"""Metering's read model for fair share over time (QueueUsageReported): decayed usage per queue and GPU model,
exact from the ledger's allocation intervals, on a real Postgres."""

from __future__ import annotations

import math

import pytest

from services.metering import store
from services.metering.testing import QUEUES_DOC, at, deliver, event, placed, spec
from shared.events import JobCompleted, QueueConfigChanged

pytestmark = pytest.mark.asyncio(loop_scope="session")
H = 3600.0


async def test_decayed_usage_integrates_each_allocation_exactly(pool) -> None:  # type: ignore[no-untyped-def]
    a = spec("a-1", team="team-a", gpus=8)  # H100-80GB, one node, 0 .. 2 h
    b = spec("b-1", team="team-b", gpus=8, model="A100-40GB")  # still running since 1 h
    nomodel = spec("c-1", team="team-a", gpus=8, model=None)  # unknown model: left out
    await deliver(pool, [event(placed(a, 0, ["h-0"]), 0), event(JobCompleted(job_id="a-1", finished_at=at(2 * H))),
                         event(placed(b, H, ["h-1"]), H), event(placed(nomodel, 0, ["h-9"]), 0)])
    half_life = 4 * H
    tau = half_life / math.log(2)
    async with pool.acquire() as conn:
        usage = await store.decayed_usage(conn, at(3 * H), half_life)
    # ∫ 8 · 2^(−(3h − t)/4h) dt over [0, 2h] and over [1h, 3h]
    expect_a = 8 * tau * (math.exp(-H / tau) - math.exp(-3 * H / tau))
    expect_b = 8 * tau * (1 - math.exp(-2 * H / tau))
    assert usage.keys() == {"team-a", "team-b"}
    assert usage["team-a"] == {"H100-80GB": pytest.approx(expect_a, rel=1e-9)}
    assert usage["team-b"] == {"A100-40GB": pytest.approx(expect_b, rel=1e-9)}
    # far in the future, an allocation ended 30 half-lives ago is left out; a running one still counts
    async with pool.acquire() as conn:
        later = await store.decayed_usage(conn, at(2 * H + 31 * half_life), half_life)
    assert "team-a" not in later and later["team-b"]["A100-40GB"] > 0
    with pytest.raises(ValueError, match="half_life_s"):
        async with pool.acquire() as conn:
            await store.decayed_usage(conn, at(0), 0)


async def test_the_half_life_follows_the_latest_configuration(pool) -> None:  # type: ignore[no-untyped-def]
    doc = QUEUES_DOC | {"policy": {"usage_half_life_s": 604800}}
    await deliver(pool, [event(QueueConfigChanged(config=doc), 10)])
    async with pool.acquire() as conn:
        assert await store.usage_half_life(conn) == 604800.0
    await deliver(pool, [event(QueueConfigChanged(config=QUEUES_DOC), 5)])  # older: ignored
    async with pool.acquire() as conn:
        assert await store.usage_half_life(conn) == 604800.0
    await deliver(pool, [event(QueueConfigChanged(config=QUEUES_DOC), 20)])  # newer, policy off
    async with pool.acquire() as conn:
        assert await store.usage_half_life(conn) is None
