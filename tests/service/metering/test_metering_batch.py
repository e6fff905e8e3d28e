"""Batched sample ingestion keeps the runtime's inbox guarantee and the ledger's exactly-once counting."""

from __future__ import annotations

import pytest

from services.metering.batch import handle_sample_batch
from services.metering.testing import event, placed, sampled, spec
from shared.events import encode_event

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_batch_records_fresh_events_once_and_hands_back_the_rest(pool):
    samples = [encode_event(event(sampled(f"n{i}", 60, f"j{i}", [40.0] * 8), 60)) for i in range(5)]
    other = encode_event(event(placed(spec("j0"), 0, ["n0"]), 0))
    async with pool.acquire() as conn:
        first = await handle_sample_batch(conn, [*samples[:3], samples[0], b"{not json", other])
        again = await handle_sample_batch(conn, samples)
        used = await conn.fetchval("SELECT sum(used_gpu_ms) FROM metering.usage_hourly")
        inbox = await conn.fetchval("SELECT count(*) FROM metering.inbox")
    assert (first.handled, first.duplicates, first.samples_inserted) == (3, 1, 24)
    assert first.rest == [b"{not json", other]
    assert (again.handled, again.duplicates, again.samples_inserted) == (2, 3, 16)
    assert used == 5 * 8 * 24_000 and inbox == 5
