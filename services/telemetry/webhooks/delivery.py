"""Sending deliveries: one attempt per claimed row, signed, to the checked address, no redirects.

At-least-once: a delivery is marked delivered only after a 2xx; a crash in between sends it again with
the same `webhook-id` (= the CloudEvent id), which receivers use to drop the copy. What the receiver answers
decides what follows (Standard Webhooks' advice): 2xx delivered; 410 Gone disables the subscription (its
deliveries wait, nothing is dropped); 429/502/503/504 throttle the whole subscription until the later of the
backoff and the `Retry-After`; anything else is retried with backoff until the policy's attempts run out, then
dead-lettered.
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
from services.telemetry.webhooks.backoff import GONE, THROTTLING, RetryPolicy, retry_after_s, timeout_from_env
from services.telemetry.webhooks.signing import signed_headers
from services.telemetry.webhooks.ssrf import AllowList, Resolver, TargetRefused, resolve_target, system_resolver
from shared.clock import Clock

log = logging.getLogger("gpuq.telemetry.webhooks")


@dataclass
class Outcome:
    ok: bool
    status_code: int | None = None
    error: str = ""
    retry_after: str | None = None  # the receiver's Retry-After header, as sent


@dataclass
class DeliveryWorker:
    pool: asyncpg.Pool
    clock: Clock
    allow: AllowList = field(default_factory=AllowList.from_env)
    policy: RetryPolicy = field(default_factory=RetryPolicy.from_env)
    rng: random.Random = field(default_factory=random.Random)
    resolver: Resolver = system_resolver
    timeout_s: float = field(default_factory=timeout_from_env)
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
        headers = signed_headers(d.secrets, d.event_id, int(self.wall()), d.body)
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
        return Outcome(False, resp.status_code, f"HTTP {resp.status_code}", resp.headers.get("retry-after"))

    async def run_once(self) -> int:
        """Attempt every due delivery once; returns how many were attempted."""
        now = self.clock.now()
        due = await store.claim_due(self.pool, now, self.lease_s, self.batch)
        held: dict[str, float] = {}  # subscriptions disabled or throttled during this batch -> resume time
        for d in due:
            if d.subscription_id in held:  # not sent: handed back untried
                await store.release(self.pool, d.id, held[d.subscription_id])
                continue
            outcome = await self.send(d)
            done_at = self.clock.now()
            if outcome.ok:
                await store.mark_delivered(self.pool, d.id, done_at, outcome.status_code or 200)
            elif outcome.status_code == GONE:
                log.warning("webhook %s answered 410 Gone: subscription disabled", d.subscription_id)
                await store.disable_subscription(self.pool, d.subscription_id, done_at,
                                                 f"HTTP 410 Gone from {d.url}")
                await store.mark_retry(self.pool, d.id, done_at, "HTTP 410: subscription disabled", GONE)
                held[d.subscription_id] = done_at
            elif self.policy.exhausted(d.attempts):
                log.warning("webhook %s for event %s dead after %d attempts: %s", d.subscription_id,
                            d.event_id, d.attempts, outcome.error)
                await store.mark_dead(self.pool, d, done_at, outcome.error, outcome.status_code)
            elif outcome.status_code in THROTTLING:
                wait = retry_after_s(outcome.retry_after, self.wall())
                delay = self.policy.delay_after(d.attempts, self.rng.random(), wait)
                await store.mark_retry(self.pool, d.id, done_at + delay, outcome.error, outcome.status_code)
                await store.postpone_subscription(self.pool, d.subscription_id, done_at + delay)
                held[d.subscription_id] = done_at + delay
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
