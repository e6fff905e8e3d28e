"""A singleton service's leadership: the leader leases it holds before consuming (shared/leader.py), the watcher
that pauses consumption the moment one is lost and takes them all again, and what /readyz says of them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from shared.health import Check
from shared.leader import LeaderLease
from shared.plumbing.spec import ServiceSpec

log = logging.getLogger("gpuq.service")

# How often a singleton checks its lease connections; how long Postgres may stay unreachable while the runtime
# takes its leases again before /healthz says "not live" (a supervisor then restarts the process: waiting longer
# in-process would not bring Postgres back sooner, but a restart clears whatever else went wrong).
LEASE_CHECK_S = 2.0
LEASE_RECOVERY_BOUND_S = 300.0


class LeadershipHost(Protocol):
    """What leadership needs of its runtime (shared/service.py ServiceRuntime)."""

    phase: str  # shared/health.py's phases: leadership moves it through standby, recovering, starting, running
    stale: bool  # memory may be ahead of the tables: set while another instance may lead

    @property
    def spec(self) -> ServiceSpec: ...

    async def pause_consumption(self) -> None: ...

    async def resume_consumption(self) -> None: ...


class Leadership:
    """The leases of one runtime and their recovery. It moves the runtime's `phase` (standby, recovering, starting,
    running) and pauses and resumes its consumption; a runtime that is no singleton has no leases."""

    def __init__(self, runtime: LeadershipHost, database_url: str | None):
        self.rt = runtime
        spec = runtime.spec
        self.leases: list[LeaderLease] = []
        if spec.singleton:
            if database_url is None:
                raise ValueError(f"{spec.name} is a singleton service: pass database_url for its leader lease")
            self.leases = [LeaderLease(database_url, spec.schema, scope, shared=True)
                           for scope in spec.shared_lease_scopes]
            self.leases += [LeaderLease(database_url, spec.schema, scope)
                            for scope in (spec.lease_scopes or (spec.name,))]
        # The first exclusive lease: its term is the fencing token of a service with one scope.
        self.lease: LeaderLease | None = next((lease for lease in self.leases if not lease.shared), None)
        self.unreachable_since: float | None = None  # monotonic time since when the leases' Postgres is unreachable
        self.recovery_bound_s = LEASE_RECOVERY_BOUND_S
        self.recoveries = 0  # times the leases were lost and taken again
        self.lease_refusals = 0  # attempts at a lease that found another instance holding it
        self._deposed = asyncio.Event()  # set when a fence check failed: the watcher recovers at once

    def depose(self) -> None:
        """A unit of work found its fence superseded (another instance leads): the watcher recovers at once."""
        self._deposed.set()

    async def campaign(self) -> None:
        """Take every lease, in order (a standby waits here holding only the leases before). Postgres being
        unreachable is retried with a capped backoff (shared/leader.py): phase "recovering" while it cannot be
        asked, "standby" while another instance holds a lease."""
        self.rt.phase = "standby"

        def attempted(error: BaseException | None) -> None:
            if error is None:
                self.lease_refusals += 1  # another instance holds it: `gpuq up` says STANDBY only then
                self.rt.phase, self.unreachable_since = "standby", None
            else:
                self.rt.phase = "recovering"
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
        # Leases already taken must not sit idle past their TTL while a later one is waited for.
        async with self.kept_alive():
            for lease in self.leases:
                await lease.acquire(on_attempt=attempted)
        self.unreachable_since = None

    async def watch(self) -> None:
        """Stop consuming the moment a lease connection is gone (another instance may lead now), then campaign
        again: a restarted Postgres, or a network blip, costs a pause, never a live process that does nothing.
        The NATS connection stays up meanwhile, so the outbox relay keeps publishing what was committed."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deposed.wait(), timeout=LEASE_CHECK_S)
            if self._deposed.is_set():  # a unit of work found its fence superseded: another instance leads
                lost = [lease.scope for lease in self.leases if not lease.shared]
            else:
                lost = [lease.scope for lease in self.leases if not await lease.alive()]
            if not lost:
                continue
            self._deposed.clear()
            log.error("%s: lost the leader lease %s; pausing consumption and taking the leases again",
                      self.rt.spec.name, ", ".join(lost))
            while True:  # the recovery itself may meet the outage again: it starts over until it succeeds
                try:
                    await self.recover()
                    break
                except Exception:
                    log.exception("%s: recovery failed; starting it over in 1 s", self.rt.spec.name)
                    await asyncio.sleep(1.0)

    async def recover(self) -> None:
        """Pause consumption, give every lease back, take them again, reload memory from the tables, resume."""
        self.rt.phase = "recovering"
        if self.unreachable_since is None:
            self.unreachable_since = time.monotonic()
        await self.rt.pause_consumption()
        for lease in reversed(self.leases):  # all of them: the leases are taken in order, or not at all
            with contextlib.suppress(Exception):
                await lease.release()
        self.rt.stale = True  # another instance may have led meanwhile: memory is rebuilt from the tables
        await self.campaign()
        self.rt.phase = "starting"
        if self.rt.spec.on_start is not None:
            # The lease sessions must not sit idle past their TTL while the state reloads.
            async with self.kept_alive():
                await self.rt.spec.on_start(self.rt)
        self.rt.stale = False
        await self.rt.resume_consumption()
        self.recoveries += 1
        self.rt.phase = "running"
        log.warning("%s: leader again (term %s); consuming", self.rt.spec.name,
                    self.lease.term if self.lease else "-")

    @contextlib.asynccontextmanager
    async def kept_alive(self) -> AsyncIterator[None]:
        """Query the held leases every few seconds while the body runs, so that none sits idle past its TTL. The
        keeper is stopped between queries, never cancelled inside one: a query cancelled half-way leaves its
        connection unusable for the next one (the watcher's)."""
        done = asyncio.Event()

        async def keep() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=LEASE_CHECK_S)
                if done.is_set():
                    return
                for lease in self.leases:
                    if lease.held:  # never the one being acquired: its connection is busy with that
                        await lease.alive()

        keeper = asyncio.create_task(keep())
        try:
            yield
        finally:
            done.set()
            await asyncio.wait({keeper}, timeout=10)
            if not keeper.done():
                keeper.cancel()

    def check(self) -> tuple[Check, bool]:
        """The leases' readiness check for /readyz, and whether the process is live (see `recovery_bound_s`).
        Queries nothing on the lease connections: the watcher uses them."""
        phase = self.rt.phase
        if phase == "standby":
            held = sum(lease.held for lease in self.leases)
            return Check(ok=True, detail=f"standing by ({held} of {len(self.leases)} leases held)"), True
        if phase == "recovering":
            # Consumption is paused and the leases are being taken again (the watcher campaigns): not ready.
            # Live while that is worth waiting for; a Postgres unreachable for longer than the recovery bound
            # makes it not live, so that a supervisor restarts the process (LEASE_RECOVERY_BOUND_S).
            down = time.monotonic() - self.unreachable_since if self.unreachable_since is not None else 0.0
            return Check(ok=False, detail=f"recovering: Postgres unreachable for {down:.0f} s, "
                                          "taking the leases again"), down <= self.recovery_bound_s
        if phase in ("starting", "running"):
            lost = sorted(lease.scope for lease in self.leases if not lease.held)
            return Check(ok=not lost, detail=f"lost: {', '.join(lost)}" if lost else
                         f"held (term {self.lease.term if self.lease else '-'})"), True
        return Check(ok=False, detail="not held"), True
