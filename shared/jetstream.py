"""JetStream's pull and publish protocols in batches, at a cost per message of little more than its bytes.

nats-py gives each message of a batch its own machinery. `PullSubscription.fetch` waits for every message with
`Subscription.next_msg`, which creates a task, an `asyncio.wait_for` timer and a uuid4 for each one;
`publish_async` makes a future with a done callback, a semaphore wait and a random token for each message, and
decodes each acknowledgement into a `PubAck`. Every service pays that for every delivery and every event it emits
(some ten deliveries and three events per job): measured on the development machine, 35 µs of CPU per pulled
message, a sixth of the platform's CPU in a burst (docs/benchmarks.md §4). The two classes here speak the same
protocols through plain subscriptions of nats-py's client:

- `Puller`: JetStream's pull API, a request on `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` with the puller's
  inbox as its reply subject, answered by up to `batch` messages on that inbox and ended early by a status
  message (404 No Messages for a `no_wait` request, 408 Request Timeout when a waiting request expires). The inbox
  is subscribed with a callback that only appends to a list; a fetch waits once for each read of the socket that
  brings messages, not once for each message. `fetch` behaves like nats-py's: it returns what is already there at
  once (with a `no_wait` top-up), and when nothing is, it waits for the first message and returns with it. A
  waiting request stays open on the server after that until its batch is full or it expires; whatever it still
  brings is kept, in stream order, for the next fetch.
- `BatchPublisher`: each message is published with a reply subject of its own under one wildcard subscription
  (`<inbox>.<batch>.<index>`), the stream's acknowledgement (`{"stream": ..., "seq": ...}`) is recognised without
  decoding it, a refusal is decoded into nats-py's own error classes, and the batch waits once for all of them.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NoStreamResponseError, ServerError

JS_API_PREFIX = "$JS.API"  # the default API prefix, which gpuq's connections use (no JetStream domain)
STATUS_HEADER = "Status"
NO_MESSAGES = "404"
REQUEST_TIMEOUT = "408"
CONFLICT = "409"  # e.g. "Exceeded MaxWaiting" or "Leadership Change": the request is gone, the next one may work
HEARTBEAT = "100"
ENDS_A_REQUEST = frozenset({NO_MESSAGES, REQUEST_TIMEOUT, CONFLICT})
EXPIRY_MARGIN_NS = 100_000  # a waiting request expires just before the fetch gives up, so its 408 is not left over
NO_RESPONDERS = "503"  # a publish no stream captures
ACK_START = b'{"stream"'


def unique_inbox(nc: Client, inbox_prefix: str) -> str:
    """A new inbox subject under the connection's permitted reply prefix, as nats-py's pull subscriptions make
    theirs."""
    return f"{inbox_prefix.rstrip('.')}.{nc.new_inbox().rsplit('.', 1)[-1]}"


def status_of(msg: Msg) -> str | None:
    """The status code of a server's status message (no body, a `Status` header), None for any other message."""
    return msg.headers.get(STATUS_HEADER) if msg.headers else None


class PullError(Exception):
    """The server answered a pull with a status that is not part of a normal exchange (for example 400 Bad
    Request). The message names the status and its description. (A pull of a consumer that does not exist gets no
    answer at all on NATS 2.9: it times out.)"""


class Puller:
    """One durable consumer's deliveries through one inbox subscription. `start` subscribes, `fetch` pulls,
    `close` unsubscribes; a Puller is used by one task at a time."""

    def __init__(self, nc: Client, stream: str, consumer: str, inbox_prefix: str) -> None:
        self._nc = nc
        self._next_subject = f"{JS_API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox_prefix = inbox_prefix
        self._inbox = ""
        self._sub: Subscription | None = None
        self._box: deque[Msg] = deque()
        self._arrived = asyncio.Event()

    @property
    def inbox(self) -> str:
        return self._inbox

    async def start(self) -> None:
        self._inbox = unique_inbox(self._nc, self._inbox_prefix)
        self._sub = await self._nc.subscribe(self._inbox, cb=self._deliver)

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def _deliver(self, msg: Msg) -> None:
        self._box.append(msg)
        self._arrived.set()

    def _take(self, limit: int, into: list[Msg]) -> str | None:
        """Move up to `limit` messages from the box into `into`, in arrival order; return the status that ended a
        request if one was met (the messages after it stay in the box), else None. Heartbeats are dropped; a
        status that is no part of a normal exchange raises PullError when nothing was taken."""
        box = self._box
        while box and limit > 0:
            msg = box.popleft()
            status = status_of(msg)
            if status is None:
                into.append(msg)
                limit -= 1
            elif status in ENDS_A_REQUEST:
                return status
            elif status != HEARTBEAT:
                if not into:
                    description = msg.headers.get("Description", "") if msg.headers else ""
                    raise PullError(f"pull from {self._next_subject} answered {status} {description}".rstrip())
                box.appendleft(msg)  # raised by the next fetch, after this one's messages are handled
                return status
        return None

    async def _wait(self, deadline: float) -> bool:
        """Wait until the box holds a message or the loop's clock reaches `deadline`; False on the deadline."""
        if self._box:
            return True
        self._arrived.clear()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        try:
            async with asyncio.timeout(left):
                await self._arrived.wait()
        except TimeoutError:
            return False
        return True

    async def _request(self, batch: int, *, no_wait: bool = False, expires_s: float = 0.0) -> None:
        request: dict[str, object] = {"batch": batch}
        if no_wait:
            request["no_wait"] = True
        else:
            request["expires"] = max(1, int(expires_s * 1e9) - EXPIRY_MARGIN_NS)
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)

    async def fetch(self, batch: int, timeout: float, *, wait: bool = True) -> list[Msg]:
        """Up to `batch` messages in stream order: those already here, topped up with what the consumer has now;
        when it has none, the first to arrive within `timeout` seconds (raises TimeoutError when none arrives), or
        with `wait=False` none."""
        if self._sub is None:
            raise RuntimeError("Puller.fetch before start")
        loop = asyncio.get_running_loop()
        msgs: list[Msg] = []
        self._take(batch, msgs)  # a status met here ended an earlier request: nothing to wait for from it
        deadline = loop.time() + timeout
        if len(msgs) < batch:
            await self._request(batch - len(msgs), no_wait=True)
            # Until this request's end (a status; an earlier request's late 408 only makes it return sooner).
            while len(msgs) < batch and await self._wait(deadline):
                if self._take(batch - len(msgs), msgs) is not None:
                    break
        if msgs or not wait:
            return msgs
        await self._request(batch, expires_s=max(0.0, deadline - loop.time()))
        while not msgs:
            # Statuses are passed over here: they end earlier requests (this one's 408 comes at the deadline).
            if not await self._wait(deadline):
                raise TimeoutError(f"no message from {self._next_subject} within {timeout} s")
            self._take(batch, msgs)
        return msgs


class BatchPublisher:
    """Publishes batches of messages to JetStream and waits for their acknowledgements together. `start`
    subscribes the reply inbox, `publish` sends one batch (concurrent batches are kept apart by their number),
    `close` unsubscribes."""

    def __init__(self, nc: Client, inbox_prefix: str) -> None:
        self._nc = nc
        self._inbox_prefix = inbox_prefix
        self._replies = ""
        self._sub: Subscription | None = None
        self._batches: dict[str, _Batch] = {}
        self._next_batch = 0

    @property
    def connection(self) -> Client:
        return self._nc

    async def start(self) -> None:
        self._replies = unique_inbox(self._nc, self._inbox_prefix)
        self._sub = await self._nc.subscribe(f"{self._replies}.>", cb=self._reply)

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def publish(self, messages: Sequence[tuple[str, bytes, dict[str, str]]],
                      timeout: float) -> list[Exception | None]:
        """Publish (subject, body, headers) messages in order; return, for each, None once the stream stored it (or
        knew it already: a duplicate Nats-Msg-Id) or the error the server answered with (nats-py's classes:
        `NoStreamResponseError` when no stream captures the subject, an `APIError` subclass for a refusal).
        Raises TimeoutError when some acknowledgement has not come within `timeout` seconds."""
        if self._sub is None:
            raise RuntimeError("BatchPublisher.publish before start")
        if not messages:
            return []
        self._next_batch += 1
        number = str(self._next_batch)
        batch = _Batch(len(messages))
        self._batches[number] = batch
        try:
            prefix = f"{self._replies}.{number}."
            for index, (subject, body, headers) in enumerate(messages):
                await self._nc.publish(subject, body, reply=f"{prefix}{index}", headers=headers)
            async with asyncio.timeout(timeout):
                await batch.done.wait()
        finally:
            del self._batches[number]
        return batch.results

    async def _reply(self, msg: Msg) -> None:
        _, number, index = msg.subject.rsplit(".", 2)
        batch = self._batches.get(number)
        if batch is None:  # a batch that timed out, or a reply to nothing of ours
            return
        batch.settle(int(index), _outcome(msg))


class _Batch:
    __slots__ = ("done", "results", "waiting")

    def __init__(self, size: int) -> None:
        self.results: list[Exception | None] = [None] * size
        self.waiting = set(range(size))
        self.done = asyncio.Event()

    def settle(self, index: int, outcome: Exception | None) -> None:
        if index in self.waiting:  # a second reply to one message (a server retry) changes nothing
            self.waiting.discard(index)
            self.results[index] = outcome
            if not self.waiting:
                self.done.set()


def _outcome(msg: Msg) -> Exception | None:
    """None for an acknowledgement; else the error a reply says, classified as nats-py's publish would."""
    data = msg.data
    if data.startswith(ACK_START) and b'"error"' not in data:
        return None
    status = status_of(msg)
    if status == NO_RESPONDERS:
        return NoStreamResponseError()
    try:
        answer = json.loads(data) if data else {}
    except ValueError:
        answer = {}
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        try:
            APIError.from_error(answer["error"])  # raises the class for its code, as nats-py's publish does
        except APIError as refusal:
            return refusal
    if isinstance(answer, dict) and "stream" in answer and "seq" in answer:
        return None
    return ServerError(description=f"an unreadable acknowledgement (status {status}): {data[:200]!r}")
