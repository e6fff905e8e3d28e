"""Leadership: the executor is a singleton (leader + hot standby), and only the leader may act on the cluster.

Every unit of work an informer or a timer starts is fenced here, as the bus handlers are by `fence.fenced`: a
former leader whose lease has passed fails its transaction (LostLeadership) instead of acting beside the new one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.executor import fence
from shared.service import ServiceRuntime, Tx


class Seat:
    """The executor's runtime once started, and its fenced units of work."""

    def __init__(self) -> None:
        self.runtime: ServiceRuntime | None = None

    def rt(self) -> ServiceRuntime:
        assert self.runtime is not None, "the executor has not started"
        return self.runtime

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        """A unit of work that fails unless this instance still leads."""
        async with self.rt().transaction() as tx:
            await fence.check(tx, self.runtime)
            yield tx
