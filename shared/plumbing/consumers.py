"""A service's consumption: its durable pull consumers (created, or their filters brought up to date in place),
one pull loop per consumer handing each pulled batch to the runtime, and what /readyz says of their progress."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from faststream.nats import NatsBroker
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as NatsAckPolicy
from nats.js.api import ConsumerConfig as NatsConsumerConfig
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from shared.bus import ConsumerPlan, consumer_plan, matches, takes_filter_subjects
from shared.health import CHECK_TIMEOUT_S, Check, ConsumerState
from shared.jetstream import Puller
from shared.plumbing.batches import Batches
from shared.plumbing.spec import ServiceSpec
from shared.plumbing.units import BatchHandler
from shared.settings import settings

log = logging.getLogger("gpuq.service")

MAX_DELIVER = 8
ACK_WAIT_S = 30.0
# How many delivered messages a consumer may hold unacknowledged, those waiting for their redelivery (nak with
# delay) included. JetStream's default, 1,000, let a flood of failing messages (issue 43: 1,500 submissions
# Postgres refused) fill it for their whole backoff, so that nothing behind them was delivered for a minute.
MAX_ACK_PENDING = 20_000
# A consumer that has not settled a batch (nor found nothing to take) for this long while messages wait for it is
# reported not ready by /readyz (GPUQ_CONSUMER_STALL_S): a wedged or blocked consumer must not look healthy.
STALL_ENV = "GPUQ_CONSUMER_STALL_S"
DEFAULT_STALL_S = 60.0
# Consumption: messages per pull, and how long a pull waits for the first one. A pulled batch is handled in one
# transaction (one savepoint per message) and settled after its commit.
FETCH_BATCH = 256
FETCH_WAIT_S = 1.0

def stall_after_from_env(env: Mapping[str, str] = os.environ) -> float:
    """GPUQ_CONSUMER_STALL_S: seconds without progress, messages waiting, before a consumer counts as stalled."""
    return settings(env).consumer_stall_s


@dataclass
class _ConsumerWatch:
    """One consumer's pull loop as health() judges it: whether it still runs, and when it last settled a batch or
    found nothing to take (monotonic seconds)."""

    stream: str
    durable: str
    progress_at: float
    task: asyncio.Task[None]
    blocked_since: float | None = None  # first seen unable to take more (its unacknowledged messages at the limit)


def _settled(m: Msg) -> bool:
    """Was `m` acked, nak'd or terminated? (nats-py marks it so, and refuses to settle it twice.)"""
    return bool(getattr(m, "_ackd", False))


def _filters_of(config: NatsConsumerConfig) -> tuple[str, ...]:
    """A consumer's filter subjects, however given: `filter_subjects` (NATS >= 2.10) or `filter_subject`; empty:
    the whole stream."""
    if config.filter_subjects:
        return tuple(sorted(config.filter_subjects))
    return (config.filter_subject,) if config.filter_subject else ()


def _with_filters(config: NatsConsumerConfig, filters: tuple[str, ...]) -> NatsConsumerConfig:
    """`config` filtering on `filters`: one as `filter_subject` (every NATS version), several as `filter_subjects`
    (NATS >= 2.10). The server refuses both at once, so the other field is cleared (None: not sent)."""
    if len(filters) == 1:
        return replace(config, filter_subject=filters[0], filter_subjects=None)
    return replace(config, filter_subject=None, filter_subjects=list(filters))


class ConsumptionHost(Protocol):
    """What consumption needs of its runtime (shared/service.py ServiceRuntime)."""

    @property
    def spec(self) -> ServiceSpec: ...

    @property
    def broker(self) -> NatsBroker: ...

    @property
    def batches(self) -> Batches: ...

    async def settle_message(self, raw: Msg) -> None: ...


class Consumption:
    """The pull consumers of one runtime and their loops. What a pulled batch does is the runtime's (its batch
    path, `ServiceRuntime.batches`); this class pulls, hands over, and watches progress."""

    def __init__(self, runtime: ConsumptionHost, inbox_prefix: str):
        self.rt = runtime
        spec = runtime.spec
        batch_subjects = {cls.subject(): fn for cls, fn in spec.batch_handlers.items()}
        # (plan, durable name, batch handler): one durable pull consumer each, pulled by this runtime's own loop
        # (`_consume`), which settles each message itself in stream order. A batch handler takes a consumer whose
        # one subject is its event type's. What a consumer filters on depends on the server (`start`).
        self.plans: list[tuple[ConsumerPlan, str, BatchHandler | None]] = [
            (plan, f"{spec.name}{spec.consumer_suffix}-{plan.suffix}",
             batch_subjects.get(plan.subjects[0]) if len(plan.subjects) == 1 else None)
            for plan in consumer_plan([*spec.handlers, *spec.batch_handlers])]
        # The subscriptions of the handled types: a message on any other subject of a consumer's filter is acked
        # unread (routing on the subject, before any parsing).
        self.routes = tuple(sorted({cls.subscription() for cls in spec.handlers}))
        self._routed: dict[str, bool] = {}
        self.inbox_prefix = inbox_prefix  # the pull requests' replies
        self.tasks: list[asyncio.Task[None]] = []  # one pull loop per durable consumer
        self.watches: dict[str, _ConsumerWatch] = {}  # durable name -> its loop's progress, for `check`
        self.stall_after_s = stall_after_from_env()

    def routed(self, subject: str) -> bool:
        """Does a handler of this service take events on `subject`? (Read from the subject alone: a message on a
        subject no handler takes is acked without parsing its body.)"""
        known = self._routed.get(subject)
        if known is None:  # subjects repeat (one per event type and team): decide each once
            known = self._routed[subject] = any(matches(pattern, subject) for pattern in self.routes)
            if len(self._routed) > 10_000:  # bounded (team names come from publishers)
                self._routed.clear()
        return known

    async def start(self) -> None:
        """Create the durable pull consumers that do not exist yet (an existing one is kept: its pending messages
        are the service's), then pull each in a task of its own.

        A consumer filters on exactly the subjects the service's handlers take of its stream pattern: one subject,
        or several where the server takes several filters (NATS >= 2.10, read from the connection's server info),
        else the pattern itself (NATS 2.9: the subjects no handler takes are acked unread, `routed`).

        An existing consumer whose filter is not the one the handlers call for now (the service handles more or
        fewer event types of that stream than when the consumer was made, or the server was upgraded to take
        several filters) has its filter updated in place, between `filter_subject` and `filter_subjects` either
        way: JetStream keeps its position, so it goes on from where it was, receiving what the handlers take. A
        server that refuses the update leaves the consumer as it was (a wider filter only costs deliveries acked
        unread)."""
        js = self.rt.broker.config.connection_state.stream
        version = self.rt.broker.config.connection_state.connection.connected_server_version
        multi_filter = takes_filter_subjects(version.major, version.minor)
        for plan, durable, _ in self.plans:
            await self.ensure(js, plan, durable, plan.filters(multi_filter))
        for plan, durable, batch_fn in self.plans:
            task = asyncio.create_task(
                self._consume(plan.stream.name, " ".join(plan.filters(multi_filter)), durable, batch_fn),
                name=f"{self.rt.spec.name}-consume-{durable}")
            self.watches[durable] = _ConsumerWatch(plan.stream.name, durable, time.monotonic(), task)
            self.tasks.append(task)

    async def ensure(self, js: JetStreamContext, plan: ConsumerPlan, durable: str,
                     wanted: tuple[str, ...]) -> None:
        """Create consumer `durable` filtering on `wanted`, or bring an existing one's filter to it in place."""
        stream = plan.stream.name
        try:
            info = await js.consumer_info(stream, durable)
        except NotFoundError:
            info = await js.add_consumer(stream, _with_filters(NatsConsumerConfig(
                durable_name=durable, ack_policy=NatsAckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                max_deliver=MAX_DELIVER, ack_wait=ACK_WAIT_S, max_ack_pending=MAX_ACK_PENDING), wanted))
            self._check_filters(durable, _filters_of(info.config), wanted)
            return
        had = _filters_of(info.config)
        limit = info.config.max_ack_pending
        roomy = limit is not None and (limit < 0 or limit >= MAX_ACK_PENDING)  # -1: no limit
        if had == wanted and roomy:
            return
        # A consumer made before MAX_ACK_PENDING gets it in place too (JetStream updates it, keeping its position).
        config = _with_filters(info.config, wanted) if roomy else \
            replace(_with_filters(info.config, wanted), max_ack_pending=MAX_ACK_PENDING)
        try:
            info = await js.add_consumer(stream, config)
        except APIError as exc:
            log.warning("%s: consumer %s keeps its filter %s (%s wanted): %s", self.rt.spec.name, durable, list(had),
                        list(wanted), exc)
            return
        log.info("%s: consumer %s now filters %s (was %s)", self.rt.spec.name, durable, list(wanted), list(had))
        self._check_filters(durable, _filters_of(info.config), wanted)

    def _check_filters(self, durable: str, got: tuple[str, ...], wanted: tuple[str, ...]) -> None:
        """Warn when the server's answer shows other filters than were asked for: a server that reports a version
        taking several filters but dropped them (a cluster mid-upgrade whose consumer leader is older; ADR-34 has
        clients check the answer). Nothing is lost: a message no handler takes is acked unread (`routed`)."""
        if got != wanted:
            log.warning("%s: consumer %s filters %s, not the %s asked for", self.rt.spec.name, durable, list(got),
                        list(wanted))

    async def _consume(self, stream: str, subject: str, durable: str, batch_fn: BatchHandler | None) -> None:
        """Pull batches from one durable consumer and settle every message, until the connection is closed (the
        broker stopped: shutdown, or a lost lease) or the task is cancelled. A failed pull (a timeout, a status
        the server answers a pull with, a reconnection) is followed by the next one: it never ends consumption."""
        nc = self.rt.broker.config.connection_state.connection
        watch = self.watches[durable]
        puller = Puller(nc, stream, durable, self.inbox_prefix)
        await puller.start()
        try:
            while True:
                try:
                    msgs = await puller.fetch(FETCH_BATCH, timeout=FETCH_WAIT_S)
                    if self.rt.spec.batch_linger_s > 0 and len(msgs) < FETCH_BATCH:
                        await asyncio.sleep(self.rt.spec.batch_linger_s)
                        msgs += await puller.fetch(FETCH_BATCH - len(msgs), timeout=FETCH_WAIT_S, wait=False)
                except TimeoutError:
                    watch.progress_at = time.monotonic()  # nothing to take: as far along as it can be
                    continue
                except Exception as exc:
                    if nc.is_closed:
                        log.info("%s: stopped consuming %s: the connection is closed", self.rt.spec.name, subject)
                        return
                    log.warning("%s: pull from %s failed, pulling again: %s: %s", self.rt.spec.name, durable,
                                type(exc).__name__, exc)
                    await asyncio.sleep(0.5)
                    continue
                try:
                    if batch_fn is not None:
                        await self.rt.batches.hand_over(batch_fn, msgs)
                    else:
                        await self.rt.batches.process(msgs)
                except Exception:
                    # Nothing a batch holds may end consumption (issue 43: one body stopped a consumer for good):
                    # what the batch path left unsettled takes the per-message path.
                    log.exception("%s: a batch of %d from %s failed; settling its messages one by one",
                                  self.rt.spec.name, len(msgs), durable)
                    await self.settle_each(msgs)
                watch.progress_at = time.monotonic()
        finally:
            with contextlib.suppress(Exception):
                await puller.close()

    async def settle_each(self, msgs: Sequence[Msg]) -> None:
        """Settle each message not yet settled on the per-message path (handled, or nak'd and dead-lettered at
        MAX_DELIVER). A message even that cannot settle (Postgres or NATS gone) is left to JetStream, which delivers it
        again after the ack wait, at most MAX_DELIVER times."""
        for m in msgs:
            if _settled(m):
                continue
            try:
                if self.routed(m.subject):
                    await self.rt.settle_message(m)
                else:
                    await m.ack()
            except Exception as exc:
                log.error("%s: could not settle the message on %s (seq %s), JetStream delivers it again: %s: %s",
                          self.rt.spec.name, m.subject, m.metadata.sequence.stream, type(exc).__name__, exc)

    async def check(self) -> tuple[Check, list[ConsumerState]]:
        """Is every consumer advancing? Not when its loop has stopped; nor when messages wait for it (the server's
        count: not yet delivered, or delivered and unacknowledged) and it has neither settled a batch nor found
        nothing to take for `stall_after_s` (a handler stuck, a loop wedged); nor when it has been unable to take
        more for that long (as many delivered messages unacknowledged as the consumer allows, others behind them:
        a flood of failing messages waiting out their backoff). One consumer-info request per consumer."""
        js = self.rt.broker.config.connection_state.stream
        watches = list(self.watches.values())
        infos = await asyncio.gather(*(asyncio.wait_for(js.consumer_info(w.stream, w.durable), CHECK_TIMEOUT_S)
                                       for w in watches), return_exceptions=True)
        now = time.monotonic()
        states: list[ConsumerState] = []
        problems: list[str] = []
        for watch, info in zip(watches, infos, strict=True):
            idle = now - watch.progress_at
            waiting: int | None = None
            problem: str | None = None
            if watch.task.done():
                error = None if watch.task.cancelled() else watch.task.exception()
                problem = f"{watch.durable}: its loop has stopped" + (
                    f" ({type(error).__name__}: {error})" if error is not None else "")
            if isinstance(info, BaseException):
                info = None  # no answer: the NATS check says why; judged on what the loop knows
            if info is not None:
                pending, unacked = info.num_pending or 0, info.num_ack_pending or 0
                waiting = pending + unacked
                limit = info.config.max_ack_pending
                full = pending > 0 and limit is not None and 0 < limit <= unacked
                watch.blocked_since = (watch.blocked_since or now) if full else None
                if problem is None and waiting > 0 and idle > self.stall_after_s:
                    problem = f"{watch.durable}: no progress for {idle:.0f} s with {waiting} messages waiting"
                elif problem is None and watch.blocked_since is not None \
                        and now - watch.blocked_since > self.stall_after_s:
                    problem = (f"{watch.durable}: takes nothing new for {now - watch.blocked_since:.0f} s: {unacked} "
                               f"delivered messages unacknowledged (its limit), {pending} waiting behind them")
            if problem is not None:
                problems.append(problem)
            states.append(ConsumerState(consumer=watch.durable, waiting=waiting, since_progress_s=idle,
                                        stalled=problem is not None))
        if problems:
            return Check(ok=False, detail="; ".join(problems)), states
        return Check(ok=True, detail=f"{len(watches)} advancing"), states
