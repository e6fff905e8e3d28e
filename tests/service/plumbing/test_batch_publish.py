"""`shared.jetstream.BatchPublisher` against a real JetStream server: a batch is stored in order and each message's
outcome is its own (stored, a duplicate id, a refusal, no stream), and a batch whose acknowledgements do not come
times out instead of waiting forever."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError

from shared.jetstream import BatchPublisher


@dataclass
class Stream:
    nc: Client
    js: JetStreamContext
    name: str
    publisher: BatchPublisher

    def message(self, n: int, *, msg_id: str | None = None, stream: str | None = None,
                subject: str | None = None) -> tuple[str, bytes, dict[str, str]]:
        return (subject or f"{self.name}.event", str(n).encode(),
                {"Nats-Msg-Id": msg_id or f"{self.name}-{n}", "Nats-Expected-Stream": stream or self.name})

    async def stored(self) -> list[int]:
        info = await self.js.stream_info(self.name)
        return [int((await self.js.get_msg(self.name, seq)).data or b"")
                for seq in range(info.state.first_seq, info.state.last_seq + 1)] if info.state.messages else []


@pytest_asyncio.fixture
async def stream(nats_url: str) -> AsyncIterator[Stream]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    name = f"pubtest{uuid.uuid4().hex[:10]}"  # this test's own stream, deleted after it
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.event"]))
    publisher = BatchPublisher(nc, "_INBOX")
    await publisher.start()
    try:
        yield Stream(nc, js, name, publisher)
    finally:
        await publisher.close()
        await js.delete_stream(name)
        await nc.close()


async def test_a_batch_is_stored_in_order_and_a_repeated_id_once(stream: Stream) -> None:
    results = await stream.publisher.publish([stream.message(n) for n in range(300)], timeout=30)
    assert results == [None] * 300
    again = await stream.publisher.publish([stream.message(300), stream.message(7, msg_id=f"{stream.name}-7")],
                                           timeout=30)
    assert again == [None, None]  # the duplicate is acknowledged, not an error
    assert await stream.stored() == [*range(300), 300]


async def test_each_message_gets_its_own_outcome(stream: Stream) -> None:
    results = await stream.publisher.publish([
        stream.message(1),
        stream.message(2, stream="NOT_THIS_STREAM"),  # the expected stream does not match: refused
        stream.message(3, subject=f"{stream.name}.nowhere"),  # no stream captures it: nobody answers
        stream.message(4),
    ], timeout=30)
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], BadRequestError) and "expected stream does not match" in str(results[1])
    assert isinstance(results[2], NoStreamResponseError)
    assert await stream.stored() == [1, 4]


async def test_a_batch_whose_acknowledgements_do_not_come_times_out(stream: Stream) -> None:
    silent: list[Msg] = []

    async def listen(msg: Msg) -> None:  # an interested subscriber that never answers: no 503 either
        silent.append(msg)

    sub = await stream.nc.subscribe(f"{stream.name}.silent", cb=listen)
    with pytest.raises(TimeoutError):
        await stream.publisher.publish([stream.message(1), stream.message(2, subject=f"{stream.name}.silent")],
                                       timeout=0.5)
    await sub.unsubscribe()
    assert len(silent) == 1
    # the publisher goes on with the next batch; the late batch's replies find nothing waiting
    assert await stream.publisher.publish([stream.message(3)], timeout=30) == [None]
    assert await stream.stored() == [1, 3]
