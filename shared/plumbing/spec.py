"""What a service declares to the runtime (`ServiceSpec`: its handlers, consumers, leases, hooks), and the counts
the runtime keeps of what it did (`Counters`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from shared.events import CloudEvent, Payload
from shared.plumbing.units import BatchHandler, Handler

# The hooks that take the runtime (`on_start`, `background`) name it `Any`: the runtime (shared/service.py) imports
# this module, and naming it here would make an import cycle.


@dataclass
class ServiceSpec:
    name: str
    schema: str
    handlers: Mapping[type[Payload], Handler]
    migrations: Path | None = None
    # Called once after migrations, before consuming: load in-memory state from the service's tables.
    on_start: Callable[[Any], Awaitable[None]] | None = None
    # Long-running loops (ticks, simulated executors), started after consuming begins, cancelled on stop.
    background: Sequence[Callable[[Any], Awaitable[None]]] = ()
    # Handle events one at a time, in stream order (the cores rely on per-job ordering).
    max_workers: int = 1
    consumer_suffix: str = ""
    # Single active instance: consume only while holding the leader lease (standbys wait).
    singleton: bool = False
    # A singleton's leases, by scope: empty = one exclusive lease named after the service. `shared_lease_scopes`
    # are held in shared mode (they exclude an exclusive holder of the same scope, not each other). All are
    # acquired before consuming, shared ones first, then exclusive ones in the given order; callers list them
    # sorted, so that instances with overlapping scopes never wait on each other in a cycle.
    lease_scopes: Sequence[str] = ()
    shared_lease_scopes: Sequence[str] = ()
    # Ownership, for services whose instances each serve part of the events (sharding): called in the unit of
    # work's transaction before the inbox row is written; False = not this instance's event, acked with nothing
    # recorded (so that the instance that owns it, now or later, still handles it).
    claim: Callable[[asyncpg.Connection, CloudEvent, Any], Awaitable[bool]] | None = None
    # Event types that every instance of a sharded service handles (configuration, inventory): their inbox row
    # is keyed by event id + consumer_suffix, so one instance's record does not hide the event from another.
    # Other events keep the plain event id: whichever instance owns one records it, once.
    broadcast: frozenset[type[Payload]] = frozenset()
    # Event types whose consumer pulls batches and hands them to one BatchHandler (see BatchHandler).
    batch_handlers: Mapping[type[Payload], BatchHandler] = field(default_factory=dict)
    # Rebuilds the service's in-memory state from its tables. Called at the start of the next unit of work
    # after one failed: a handler may have changed memory before its transaction rolled back.
    reload: Callable[[asyncpg.Connection], Awaitable[None]] | None = None
    # Handle a consumed batch without a savepoint per message (one round trip to Postgres less per message); if a
    # handler fails or refuses, the batch rolls back as a whole and is handled again with savepoints (as are the
    # next SAVEPOINT_BATCHES_AFTER_FAILURE batches). Only for a service whose memory `reload` rebuilds, or that
    # keeps none a second application of an event would change (its earlier messages are applied again).
    optimistic_batches: bool = False
    # How long a consumer waits for more messages once a batch's first has come (seconds; 0: it handles what has
    # come at once). For services whose readers can wait that long (telemetry's read models and metrics,
    # metering's charges): bigger batches, so fewer transactions and less CPU and Postgres work per event, which
    # leaves more of both to the services on a job's path to its placement; those keep 0, as every hop counts.
    batch_linger_s: float = 0.0
    # Called once per attempt at a consumed batch, after its inbox rows are claimed and before its first handler,
    # with the messages whose handlers will run (event, payload, subject; in handling order) and the batch's
    # scratch (Tx.scratch): a service may read in one statement what its handlers would otherwise read one round
    # trip each. What it leaves there must stay true for each message it serves while the batch's earlier messages
    # are handled (the service's to ensure, e.g. by serving only a job's first message of the batch). Messages
    # handled one by one (a single delivery, or a batch that failed as a whole) come without it.
    prefetch: Callable[[asyncpg.Connection, Sequence[tuple[CloudEvent, Any, str]], dict[str, Any]],
                       Awaitable[None]] | None = None


@dataclass
class Counters:
    handled: int = 0
    duplicates: int = 0
    ignored: int = 0
    retried: int = 0
    dead_lettered: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)  # dead_lettered per reason, for /metrics
    published: int = 0
    batches: int = 0  # pulled batches committed as one unit of work
    batch_retries: int = 0  # batches handled without savepoints that rolled back and were handled again with them

    def count_dead_letter(self, reason: str) -> None:
        self.dead_lettered += 1
        self.dead_letter_reasons[reason] = self.dead_letter_reasons.get(reason, 0) + 1
