"""The cyclic garbage collector's policy for a long-running service process (`gpuq up`).

CPython's full (generation 2) collection walks every tracked object, and the event loop stops meanwhile. A service
holds large, long-lived heaps: about 130,000 objects of imported modules, classes and schemas in every process,
and admission adds some 14 per waiting job. `gpuq bench e2e steady` (10,000 jobs waiting) measured the walks with a
collector callback: admission ran 16 full collections in a minute, up to 259 ms of CPU each, telemetry up to 590 ms,
every one a pause of every message behind it.

Objects that survived a full collection are, in a service, almost all state that lives on (jobs, the cluster's
nodes, modules). So after each full collection the survivors are frozen (`gc.freeze`: moved to a generation no
collection walks), and the next full collections walk only what was allocated since: on the same run, at most
65 ms of CPU each (the first, before anything was frozen), most far less. Frozen objects are still freed by their
reference counts as soon as nothing refers to them; only a reference cycle among them would wait. So every
`thaw_every_s` (`GPUQ_GC_THAW_S`, 600 s; 0: never) everything frozen is put back, collected once (one full walk,
logged with its duration) and frozen again: cycles among long-lived objects wait at most that long.
`GPUQ_GC_FREEZE=0` turns the policy off (CPython's default collector). The thresholds stay CPython's: fewer,
larger young collections (gen0 threshold 10,000) made each pause longer for no less CPU.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from shared.settings import settings

log = logging.getLogger("gpuq.gc")

THAW_EVERY_S = 600.0


class SurvivorFreezing:
    """Freezes what survives each full collection (on the event loop, soon after it), and thaws, collects and
    freezes everything again every `thaw_every_s`. One per process: `install` returns the one already installed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thaw_every_s: float):
        self.loop = loop
        self.thaw_every_s = thaw_every_s
        self.freezes = 0  # after a full collection
        self.thaws = 0
        self._pending = False
        self._task: asyncio.Task[None] | None = None

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # A collection can run in any thread that allocates (a worker thread too): the freeze itself runs on the
        # loop, once for any number of collections before it gets there.
        if phase == "stop" and info["generation"] == 2 and not self._pending and not self.loop.is_closed():
            self._pending = True
            self.loop.call_soon_threadsafe(self._freeze)

    def _freeze(self) -> None:
        self._pending = False
        gc.freeze()
        self.freezes += 1

    def start(self) -> None:
        gc.collect()  # what start-up left behind (imports, loaded state), then keep the collector off the rest
        gc.freeze()
        gc.callbacks.append(self._on_collection)
        if self.thaw_every_s > 0:
            self._task = self.loop.create_task(self._thaw_loop(), name="gc-thaw")

    def stop(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if self._task is not None:
            self._task.cancel()
        gc.unfreeze()  # back to CPython's collector for whatever runs after

    def thaw(self) -> float:
        """Put everything frozen back, collect it all once, freeze the survivors; returns the seconds it took."""
        started = time.perf_counter()
        gc.unfreeze()
        collected = gc.collect()
        gc.freeze()
        took = time.perf_counter() - started
        self.thaws += 1
        log.info("gc: periodic full collection of the frozen heap: %d unreachable objects, %.0f ms", collected,
                 took * 1000)
        return took

    async def _thaw_loop(self) -> None:
        while True:
            await asyncio.sleep(self.thaw_every_s)
            self.thaw()


def thaw_setting(environ: dict[str, str] | None = None) -> float | None:
    """The policy's setting from the environment: None when `GPUQ_GC_FREEZE` turns it off, else the thaw interval
    (`GPUQ_GC_THAW_S`, 0: never). Raises ValueError naming the variable for a value that is not one."""
    given = settings(environ)
    return given.gc_thaw_s if given.gc_freeze else None


_installed: SurvivorFreezing | None = None


def install(loop: asyncio.AbstractEventLoop | None = None, *, environ: dict[str, str] | None = None
            ) -> SurvivorFreezing | None:
    """Install the policy for this process from the environment (`thaw_setting`); None when turned off. Call it
    from a process's entry point once its services have started (`gpuq up`), not from a library."""
    global _installed
    thaw_every_s = thaw_setting(environ)
    if thaw_every_s is None:
        return None
    if _installed is None:
        policy = SurvivorFreezing(loop or asyncio.get_running_loop(), thaw_every_s)
        policy.start()
        _installed = policy
    return _installed


def uninstall() -> None:
    global _installed
    if _installed is not None:
        _installed.stop()
        _installed = None
