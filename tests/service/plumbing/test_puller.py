"""`shared.jetstream.Puller` against a real JetStream server: batches come in stream order, a partial batch returns
without waiting for the rest, a fetch on an idle consumer waits for the next message, what a waiting request
brings after a fetch returned is kept for the next fetch, and over random publishing every message comes once."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from shared.jetstream import Puller, PullError


@dataclass
class Consumer:
    nc: Client
    js: JetStreamContext
    stream: str
    subject: str
    durable: str

    async def publish(self, *numbers: int) -> None:
        for n in numbers:
            await self.js.publish(self.subject, str(n).encode(), headers={"Nats-Msg-Id": f"{self.stream}-{n}"})

    async def puller(self) -> Puller:
        puller = Puller(self.nc, self.stream, self.durable, "_INBOX")
        await puller.start()
        return puller


@pytest_asyncio.fixture
async def consumer(nats_url: str) -> AsyncIterator[Consumer]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"pulltest{uuid.uuid4().hex[:10]}"  # this test's own stream, deleted after it
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await js.add_consumer(stream, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT, ack_wait=120,
                                                 max_ack_pending=10_000))
    try:
        yield Consumer(nc, js, stream, f"{stream}.event", "c")
    finally:
        await js.delete_stream(stream)
        await nc.close()


def numbers(msgs: list) -> list[int]:
    return [int(m.data) for m in msgs]


async def test_batches_come_in_stream_order_and_a_partial_batch_returns(consumer: Consumer) -> None:
    await consumer.publish(*range(12))
    puller = await consumer.puller()
    got = []
    for _ in range(3):
        # A long timeout: a fetch that waited for a full batch instead of the no-wait request's end would hang here.
        msgs = await puller.fetch(5, timeout=60)
        for m in msgs:
            await m.ack()
        got.append(numbers(msgs))
    assert got == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert [m.metadata.sequence.stream for m in msgs] == [11, 12]
    await puller.close()


async def test_an_idle_consumer_waits_for_the_next_message_or_times_out(consumer: Consumer) -> None:
    puller = await consumer.puller()
    with pytest.raises(TimeoutError):
        await puller.fetch(10, timeout=0.3)
    fetching = asyncio.create_task(puller.fetch(10, timeout=30))
    await asyncio.sleep(0.2)
    assert not fetching.done()
    await consumer.publish(7)
    msgs = await fetching
    assert numbers(msgs) == [7]
    await msgs[0].ack()
    await puller.close()


async def test_what_a_waiting_request_brings_later_is_kept_for_the_next_fetch(consumer: Consumer) -> None:
    puller = await consumer.puller()
    fetching = asyncio.create_task(puller.fetch(10, timeout=30))
    await asyncio.sleep(0.2)
    await consumer.publish(0)
    first = await fetching
    # The waiting request is still open for nine more; these go to it, not to a new request.
    await consumer.publish(1, 2, 3)
    await asyncio.sleep(0.3)
    rest = await puller.fetch(10, timeout=30)
    assert numbers(first) == [0] and numbers(rest) == [1, 2, 3]
    for m in first + rest:
        await m.ack()
    info = await consumer.js.consumer_info(consumer.stream, consumer.durable)
    assert info.delivered.stream_seq == 4 and info.num_redelivered == 0
    await puller.close()


async def test_random_publishing_delivers_every_message_once_in_order(consumer: Consumer) -> None:
    rng = random.Random(20261202)
    total = 600
    puller = await consumer.puller()
    got: list[int] = []

    async def produce() -> None:
        n = 0
        while n < total:
            burst = min(total - n, rng.choice((1, 1, 2, 5, 17, 60)))
            await consumer.publish(*range(n, n + burst))
            n += burst
            await asyncio.sleep(rng.choice((0.0, 0.0, 0.001, 0.01, 0.05)))

    async def consume() -> None:
        while len(got) < total:
            try:
                msgs = await puller.fetch(rng.choice((1, 3, 16, 64)), timeout=0.2)
            except TimeoutError:
                continue
            got.extend(numbers(msgs))
            for m in msgs:
                await m.ack()

    await asyncio.gather(produce(), asyncio.wait_for(consume(), 120))
    assert got == list(range(total))
    await puller.close()


async def test_a_status_outside_the_exchange_is_an_error_naming_it(consumer: Consumer) -> None:
    """A 400 (here a request the server refuses, sent to the puller's inbox by hand) raises PullError with the
    server's description; 404, 408 and 409 only end a request (the other tests meet them)."""
    puller = await consumer.puller()
    await consumer.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}",
                              b'{"batch": 1, "expires": 1000000000, "idle_heartbeat": 5000000000}',
                              reply=puller.inbox)
    await asyncio.sleep(0.3)
    with pytest.raises(PullError, match="400 Bad Request - heartbeat value too large"):
        await puller.fetch(10, timeout=5)
    await consumer.publish(1)
    assert numbers(await puller.fetch(10, timeout=30)) == [1]  # the next fetch goes on
    await puller.close()
