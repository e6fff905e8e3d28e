"""Whether a service has the bus and is current: connected, and done with the backlog that waited for it.

A service that lost its NATS connection heard nothing while it was gone: not the events it waits for, not the
silence of others. Whoever judges others by what it hears (the scheduler's liveness watch) or tells others what it
knows (an executor's heartbeat listing its jobs) must first hear what was said meanwhile. `BusCatchUp.current`
answers that: False while the connection is down, and after each (re)connection (the process's start counts as one)
until every durable consumer of the service has handled the messages its stream held at that moment, and at least
`grace_s` has passed. A reconnection is seen by the client's reconnect count, so an outage shorter than the interval
between two questions is caught as well.

A consumer is caught up when nothing is waiting for it (nothing undelivered, nothing unacknowledged), or when its
acknowledgement floor has passed the stream's last sequence at the reconnection: a busy stream never empties, and
what arrived after the reconnection is new, not backlog.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.service import ServiceRuntime

log = logging.getLogger("gpuq.catchup")


@dataclass
class BusCatchUp:
    what: str  # who is asking, for the logs ("scheduler liveness", "executor heartbeat")
    grace_s: float = 0.0  # after a (re)connection, at least this long before being current again
    poll_s: float = 1.0  # how often to ask the server about the consumers while catching up
    monotonic: Callable[[], float] = time.monotonic
    _reconnects: int | None = field(default=None, init=False)  # the client's count at the connection judged
    _since: float = field(default=0.0, init=False)  # when that connection was first seen
    _targets: dict[str, int] | None = field(default=None, init=False)  # durable -> its stream's last seq then
    _current: bool = field(default=False, init=False)
    _next_poll: float = field(default=0.0, init=False)

    def forget(self) -> None:
        """Judge the connection again from now, as after a reconnection (e.g. when a lease is taken again)."""
        self._reconnects, self._targets, self._current = None, None, False

    async def current(self, runtime: ServiceRuntime) -> bool:
        """Connected, and caught up with what waited since the last (re)connection. Asks the server at most every
        `poll_s` while catching up, never once current."""
        state = runtime.broker.config.connection_state
        nc = state.connection
        if not nc.is_connected:
            if self._current:
                log.warning("%s: the bus connection is down; waiting for it, then for the backlog", self.what)
            self._current, self._targets = False, None
            return False
        reconnects = int(nc.stats.get("reconnects", 0))
        if self._current and reconnects == self._reconnects:
            return True
        now = self.monotonic()
        if reconnects != self._reconnects:  # a new connection: its backlog is measured afresh
            self._reconnects, self._since, self._targets, self._current = reconnects, now, None, False
            self._next_poll = now
        if now < self._next_poll:
            return False
        self._next_poll = now + self.poll_s
        try:
            caught_up = await self._caught_up(runtime, now)
        except Exception as exc:  # the server not answering yet (a restart, a leader election): not current
            log.info("%s: cannot tell yet whether the backlog is consumed: %s: %s", self.what, type(exc).__name__, exc)
            return False
        if caught_up:
            self._current = True
            log.info("%s: connected and caught up with the bus %.1f s after the connection", self.what,
                     now - self._since)
        return caught_up

    async def _caught_up(self, runtime: ServiceRuntime, now: float) -> bool:
        js = runtime.broker.config.connection_state.stream
        consumers = [(plan.stream.name, durable) for plan, durable, _ in runtime.consumers]
        if self._targets is None:
            self._targets = {durable: int((await js.stream_info(stream)).state.last_seq)
                             for stream, durable in consumers}
        if now - self._since < self.grace_s:
            return False
        for stream, durable in consumers:
            info = await js.consumer_info(stream, durable)
            idle = not info.num_pending and not info.num_ack_pending
            floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
            if not idle and floor < self._targets[durable]:
                return False
        return True
