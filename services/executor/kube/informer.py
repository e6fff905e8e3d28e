"""A minimal shared-informer: list, then watch from the list's resourceVersion; relist on 410 Gone (diffing
against the cache so objects deleted meanwhile are reported deleted); relist every `resync_s` as a safety net.

Each change reaches `on_change(kind, obj)` with kind ADDED, MODIFIED or DELETED; after every (re)list,
`on_synced(objects)` sees the whole cache. Handlers run one at a time, in stream order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from services.executor.kube.client import KubeApi, status_code

log = logging.getLogger("gpuq.executor.kube")

OnChange = Callable[[str, dict[str, Any]], Awaitable[None]]
OnSynced = Callable[[dict[str, dict[str, Any]]], Awaitable[None]]


def key_of(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name')}"


class Informer:
    def __init__(self, api: KubeApi, res: type, on_change: OnChange, *, labels: Mapping[str, Any] | None = None,
                 on_synced: OnSynced | None = None, resync_s: float = 300.0, name: str = "",
                 fields: Mapping[str, Any] | None = None, everywhere: bool = False):
        self.api = api
        self.res = res
        self.labels = labels
        self.fields = fields  # a field selector (an object leaving it is seen DELETED)
        self.everywhere = everywhere  # every namespace, whatever namespace the executor is limited to
        self.on_change = on_change
        self.on_synced = on_synced
        self.resync_s = resync_s
        self.name = name or res.__name__
        self.cache: dict[str, dict[str, Any]] = {}
        self.relists = 0  # how many times the informer listed (1 + relists after 410 or resync)
        self.expired = 0  # watches that ended in 410 Gone
        self.synced = asyncio.Event()

    def remember(self, obj: dict[str, Any]) -> None:
        """Record an object this process just wrote, before its watch event arrives (decisions read the cache)."""
        self.cache[key_of(obj)] = obj

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                rv = await self.relist()
                failures = 0
                await asyncio.wait_for(self._watch(rv), timeout=self.resync_s)
            except TimeoutError:
                continue  # periodic resync
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                code = status_code(exc)
                if code == 410:
                    self.expired += 1
                    log.info("%s: watch expired (410 Gone); relisting", self.name)
                    continue
                if code == 404:  # e.g. a CRD that is not installed: nothing of this kind can exist
                    log.warning("%s: not served by this cluster; looking again in %.0f s", self.name, self.resync_s)
                    await asyncio.sleep(self.resync_s)
                    continue
                failures += 1
                delay = min(30.0, 0.5 * 2 ** min(failures, 6))
                log.warning("%s: list/watch failed (%s); retrying in %.1f s", self.name, exc, delay)
                await asyncio.sleep(delay)

    async def relist(self) -> str:
        items, rv = await self.api.list(self.res, labels=self.labels, fields=self.fields, everywhere=self.everywhere)
        fresh = {key_of(o): o for o in items}
        self.relists += 1
        for key in sorted(self.cache.keys() - fresh.keys()):
            gone = self.cache.pop(key)
            await self._deliver("DELETED", gone)
        for key in sorted(fresh):
            old = self.cache.get(key)
            # Unchanged objects are delivered again too (handlers are idempotent): a resync retries what failed.
            await self._deliver("ADDED" if old is None else "MODIFIED", fresh[key])
        if self.on_synced is not None:
            await self.on_synced(dict(self.cache))
        self.synced.set()
        return rv

    async def _watch(self, rv: str) -> None:
        async for kind, obj in self.api.watch(self.res, rv, labels=self.labels, fields=self.fields,
                                              everywhere=self.everywhere):
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                await self._deliver(kind, obj)

    async def _deliver(self, kind: str, obj: dict[str, Any]) -> None:
        key = key_of(obj)
        if kind == "DELETED":
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj
        try:
            await self.on_change(kind, obj)
        except asyncio.CancelledError:
            raise
        except Exception:
            # One object's failure must not stop the stream; the next resync delivers it again.
            log.exception("%s: handling %s %s failed; it is retried at the next resync", self.name, kind, key)
