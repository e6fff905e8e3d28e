"""The executor's fence: of its replicas, only the one that holds the lease acts.

The executor runs as a leader and a hot standby (a `singleton` service: the standby waits for the Postgres lease,
shared/leader.py). Holding the lease is not enough to act on: a leader that stopped answering (paused, its event
loop stuck) past the lease's TTL has been replaced, and may wake up in the middle of a unit of work. So every unit of
work that acts as the executor (starts or stops a run, calls the Kubernetes API, reports a job's end, sends a
heartbeat) first checks, in its own transaction, that this instance's lease term is still the current one. A
superseded term raises `LostLeadership`: the transaction rolls back with whatever it was about to say, and the runtime
pauses the instance, which campaigns again as a standby. One check per transaction (a consumed batch shares it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shared.events import CloudEvent, Payload
from shared.service import Handler, ServiceRuntime, Tx

FENCED_KEY = "executor-fenced"  # in Tx.scratch: this transaction has checked the fence


async def check(tx: Tx, runtime: ServiceRuntime | None) -> None:
    """Fail (LostLeadership) unless this instance still leads; nothing to check without a lease."""
    if runtime is None or runtime.lease is None or tx.scratch.get(FENCED_KEY):
        return
    await runtime.lease.check_fence(tx.conn)
    tx.scratch[FENCED_KEY] = True


def fenced(handlers: Mapping[type[Payload], Handler],
           runtime: Callable[[], ServiceRuntime | None]) -> dict[type[Payload], Handler]:
    """The handlers, each checking the fence before it runs (`runtime` gives the instance's runtime once started)."""
    return {kind: _fenced(handler, runtime) for kind, handler in handlers.items()}


def _fenced(handler: Handler, runtime: Callable[[], ServiceRuntime | None]) -> Handler:
    async def run(tx: Tx, event: CloudEvent, payload: Any) -> None:
        await check(tx, runtime())
        await handler(tx, event, payload)

    return run
