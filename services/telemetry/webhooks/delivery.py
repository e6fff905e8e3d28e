"""Sending deliveries: one attempt per claimed row, signed, to the checked address, no redirects.

At-least-once: a delivery is marked delivered only after a 2xx; a crash in between sends it again with
the same `webhook-id` (= the CloudEvent id), which receivers use to drop the copy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg
import httpx

from services.telemetry.webhooks import store
from services.telemetry.webhooks.backoff import RetryPolicy
from services.telemetry.webhooks.signing import signed_headers
from services.telemetry.webhooks.ssrf import AllowList, Resolver, TargetRefused, resolve_target, system_resolver
from shared.clock import Clock

log = logging.getLogger("gpuq.telemetry.webhooks")


@dataclass
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str = ""


@dataclass
class DeliveryWorker:
    pool: asyncpg.Pool
    clock: Clock
    allow: AllowList = field(default_factory=AllowList.from_env)
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    rng: random.Random = field(default_factory=random.Random)
    resolver: Resolver = system_resolver
    timeout_s: float = 10.0
    lease_s: float = 60.0
    batch: int = 32
    # Signature timestamps are wall time whatever the scheduling clock is: receivers check them
    # against their own clock (Standard Webhooks' tolerance is 5 minutes).
    wall: Callable[[], float] = time.time

    async def send(self, d: store.Delivery) -> Outcome:
        try:
            target = await resolve_target(d.url, self.allow, self.resolver)
        except TargetRefused as exc:
            return Outcome(False, None, f"refused: {exc}")
        headers = signed_headers(d.secret, d.event_id, int(self.wall()), d.body)
        headers["host"] = target.host_header
        headers["user-agent"] = "gpuq-webhooks/1"
        ip = target.addresses[0]
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False, trust_env=False) as client:
                resp = await client.post(target.url_for(ip), content=d.body, headers=headers,
                                         extensions=extensions)
        except httpx.HTTPError as exc:
            return Outcome(False, None, f"{type(exc).__name__}: {exc}"[:500])
        if 200 <= resp.status_code < 300:
            return Outcome(True, resp.status_code)
        return Outcome(False, resp.status_code, f"HTTP {resp.status_code}")

    async def run_once(self) -> int:
        """Attempt every due delivery once; returns how many were attempted."""
        now = self.clock.now()
        due = await store.claim_due(self.pool, now, self.lease_s, self.batch)
        for d in due:
            outcome = await self.send(d)
            done_at = self.clock.now()
            if outcome.ok:
                await store.mark_delivered(self.pool, d.id, done_at, outcome.status_code or 200)
            elif self.policy.exhausted(d.attempts):
                log.warning("webhook %s for event %s dead after %d attempts: %s", d.subscription_id,
                            d.event_id, d.attempts, outcome.error)
                await store.mark_dead(self.pool, d, done_at, outcome.error, outcome.status_code)
            else:
                delay = self.policy.delay(d.attempts, self.rng.random())
                await store.mark_retry(self.pool, d.id, done_at + delay, outcome.error, outcome.status_code)
        return len(due)

    async def run_forever(self, idle_sleep_s: float = 1.0) -> None:
        while True:
            try:
                attempted = await self.run_once()
            except (OSError, asyncpg.PostgresError) as exc:
                log.warning("webhook worker: %s; retrying", exc)
                attempted = 0
            if attempted == 0:
                await asyncio.sleep(idle_sleep_s)
