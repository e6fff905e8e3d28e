"""Webhook subscriptions and deliveries in Postgres (`telemetry` schema, see migrations/001_init.sql)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from services.telemetry.webhooks.secrets import seal, unseal
from services.telemetry.webhooks.signing import new_secret
from shared.events import CATALOGUE, TYPE_PREFIX, CloudEvent, encode_event
from shared.secretbox import reencrypt

# What a subscription may ask for: the job lifecycle events, by short name (`job.completed`), or `*`.
# Every job event of the bus (idle reclaim's warning among them: services/telemetry/idle.py), and telemetry's own
# notifications: GPU-hour budgets at their warning level and spent (services/telemetry/budgets.py).
WEBHOOK_EVENTS: tuple[str, ...] = tuple(sorted([*(f"{c.aggregate}.{c.fact}" for c in CATALOGUE if c.aggregate == "job"),
                                                "budget.warning", "budget.exhausted"]))
ALL_EVENTS = "*"


def short_type(event_type: str) -> str:
    """`io.gpuq.job.completed.v1` -> `job.completed`."""
    name = event_type.removeprefix(TYPE_PREFIX)
    head, _, version = name.rpartition(".")
    return head if version.startswith("v") and version[1:].isdigit() else name


def validate_events(events: list[str]) -> list[str]:
    cleaned = sorted({e.strip() for e in events if e.strip()})
    if not cleaned:
        raise ValueError("name at least one event, e.g. job.completed (or * for all)")
    unknown = [e for e in cleaned if e != ALL_EVENTS and e not in WEBHOOK_EVENTS]
    if unknown:
        raise ValueError(f"unknown event(s) {', '.join(unknown)}; choose from {', '.join(WEBHOOK_EVENTS)} or *")
    return cleaned


@dataclass(frozen=True)
class Subscription:
    id: str
    url: str
    team: str | None
    events: tuple[str, ...]
    secret: str
    active: bool
    created_at: datetime
    disabled_reason: str | None = None
    previous_secret_expires_at: datetime | None = None  # a rotation in progress: the old secret signs until then


@dataclass(frozen=True)
class Delivery:
    id: int
    subscription_id: str
    event_id: str
    event_type: str
    body: bytes
    attempts: int
    url: str
    secrets: tuple[str, ...]  # the current secret, then the previous one while a rotation is in progress


def _sub(row: asyncpg.Record) -> Subscription:
    return Subscription(row["id"], row["url"], row["team"], tuple(row["event_types"]), unseal(row["secret"]),
                        row["active"], row["created_at"], row["disabled_reason"], row["previous_secret_expires_at"])


async def add_subscription(conn: asyncpg.Connection, url: str, team: str | None, events: list[str],
                           secret: str | None = None) -> Subscription:
    row = await conn.fetchrow(
        "INSERT INTO telemetry.webhook_subscriptions(id, url, team, event_types, secret) "
        "VALUES ($1, $2, $3, $4, $5) RETURNING *",
        f"wh_{uuid.uuid4().hex[:16]}", url, team, validate_events(events), seal(secret or new_secret()))
    return _sub(row)


async def rotate_secret(conn: asyncpg.Connection, sub_id: str, now: float, grace_s: float,
                        secret: str | None = None) -> Subscription | None:
    """Give a subscription a new secret; the current one keeps signing too (two signatures per delivery) for
    `grace_s`, so the receiver can switch to the new one without rejecting anything in between."""
    if grace_s < 0:
        raise ValueError("the rotation grace period cannot be negative")
    row = await conn.fetchrow(
        "UPDATE telemetry.webhook_subscriptions SET previous_secret = secret, secret = $2, "
        "previous_secret_expires_at = to_timestamp($3) WHERE id = $1 RETURNING *",
        sub_id, seal(secret or new_secret()), now + grace_s)
    return _sub(row) if row is not None else None


async def disable_subscription(conn: asyncpg.Connection | asyncpg.Pool, sub_id: str, now: float,
                               reason: str) -> None:
    """Stop sending to a subscription (its receiver said 410 Gone). Its pending deliveries stay queued, sent
    again if it is re-enabled; no new ones are queued meanwhile."""
    await conn.execute(
        "UPDATE telemetry.webhook_subscriptions SET active = false, disabled_reason = $2, "
        "disabled_at = to_timestamp($3) WHERE id = $1", sub_id, reason, now)


async def enable_subscription(conn: asyncpg.Connection, sub_id: str) -> bool:
    status = await conn.execute(
        "UPDATE telemetry.webhook_subscriptions SET active = true, disabled_reason = NULL, disabled_at = NULL "
        "WHERE id = $1", sub_id)
    return status.endswith(" 1")


async def reencrypt_secrets(conn: asyncpg.Connection) -> int:
    """Encrypt every signing secret, and a rotation's previous one, with the newest key (after a key rotation, or
    plain-text rows of old)."""
    rows = await conn.fetch("SELECT id, secret, previous_secret FROM telemetry.webhook_subscriptions ORDER BY id "
                            "FOR UPDATE")
    for r in rows:
        await conn.execute("UPDATE telemetry.webhook_subscriptions SET secret = $2, previous_secret = $3 WHERE id = $1",
                           r["id"], reencrypt(r["secret"]),
                           reencrypt(r["previous_secret"]) if r["previous_secret"] else None)
    return len(rows)


async def list_subscriptions(conn: asyncpg.Connection, team: str | None = None) -> list[Subscription]:
    rows = await conn.fetch(
        "SELECT * FROM telemetry.webhook_subscriptions WHERE $1::text IS NULL OR team = $1 "
        "ORDER BY created_at, id", team)
    return [_sub(r) for r in rows]


async def remove_subscription(conn: asyncpg.Connection, sub_id: str) -> bool:
    """Delete a subscription and its pending deliveries (dead letters are kept as a record)."""
    status = await conn.execute("DELETE FROM telemetry.webhook_subscriptions WHERE id = $1", sub_id)
    return status.endswith(" 1")


async def enqueue(conn: asyncpg.Connection, event: CloudEvent, team: str | None, now: float) -> int:
    """One delivery per matching subscription, due now. Idempotent per (subscription, event id)."""
    status = await conn.execute(
        "INSERT INTO telemetry.webhook_deliveries(subscription_id, event_id, event_type, body, next_attempt_at) "
        "SELECT id, $1, $2, $3, to_timestamp($4) FROM telemetry.webhook_subscriptions "
        "WHERE active AND (team IS NULL OR team = $5) AND ($6 = ANY(event_types) OR '*' = ANY(event_types)) "
        "ON CONFLICT (subscription_id, event_id) DO NOTHING",
        event.id, event.type, encode_event(event), now, team, short_type(event.type))
    return int(status.rsplit(" ", 1)[-1])


async def enqueue_many(conn: asyncpg.Connection, events: Sequence[tuple[CloudEvent, str | None, float]]) -> int:
    """`enqueue` for several (event, team, now) at once, in one statement (the deliveries are numbered in the
    events' order); when no subscription is active, one cheap query and no event is encoded."""
    if not events or not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM telemetry.webhook_subscriptions WHERE active)"):
        return 0
    status = await conn.execute(
        "INSERT INTO telemetry.webhook_deliveries(subscription_id, event_id, event_type, body, next_attempt_at) "
        "SELECT s.id, e.event_id, e.event_type, e.body, to_timestamp(e.now) "
        "FROM unnest($1::text[], $2::text[], $3::bytea[], $4::float8[], $5::text[], $6::text[]) "
        "WITH ORDINALITY AS e(event_id, event_type, body, now, team, short, n) "
        "JOIN telemetry.webhook_subscriptions s ON s.active AND (s.team IS NULL OR s.team = e.team) "
        "AND (e.short = ANY(s.event_types) OR '*' = ANY(s.event_types)) "
        "ORDER BY e.n, s.id ON CONFLICT (subscription_id, event_id) DO NOTHING",
        [e.id for e, _, _ in events], [e.type for e, _, _ in events], [encode_event(e) for e, _, _ in events],
        [now for _, _, now in events], [team for _, team, _ in events], [short_type(e.type) for e, _, _ in events])
    return int(status.rsplit(" ", 1)[-1])


async def claim_due(pool: asyncpg.Pool, now: float, lease_s: float, limit: int) -> list[Delivery]:
    """Take due deliveries: count the attempt and push `next_attempt_at` out by a lease, so a worker that
    dies mid-send leaves the delivery to be retried after the lease instead of lost or sent twice at once."""
    async with pool.acquire() as conn, conn.transaction():
        rows = await conn.fetch(
            "SELECT d.id, d.subscription_id, d.event_id, d.event_type, d.body, d.attempts, s.url, s.secret, "
            "CASE WHEN s.previous_secret_expires_at > to_timestamp($1) THEN s.previous_secret END AS previous "
            "FROM telemetry.webhook_deliveries d JOIN telemetry.webhook_subscriptions s "
            "ON s.id = d.subscription_id "
            "WHERE d.status = 'pending' AND s.active AND d.next_attempt_at <= to_timestamp($1) "
            "ORDER BY d.next_attempt_at, d.id LIMIT $2 FOR UPDATE OF d SKIP LOCKED", now, limit)
        if not rows:
            return []
        await conn.execute(
            "UPDATE telemetry.webhook_deliveries SET attempts = attempts + 1, "
            "next_attempt_at = to_timestamp($2) WHERE id = ANY($1::bigint[])",
            [r["id"] for r in rows], now + lease_s)
    return [Delivery(r["id"], r["subscription_id"], r["event_id"], r["event_type"], bytes(r["body"]),
                     r["attempts"] + 1, r["url"],
                     (unseal(r["secret"]),) + ((unseal(r["previous"]),) if r["previous"] else ())) for r in rows]


async def mark_delivered(pool: asyncpg.Pool, delivery_id: int, now: float, status_code: int) -> None:
    await pool.execute(
        "UPDATE telemetry.webhook_deliveries SET status = 'delivered', delivered_at = to_timestamp($2), "
        "last_status = $3, last_error = NULL WHERE id = $1", delivery_id, now, status_code)


async def mark_retry(pool: asyncpg.Pool, delivery_id: int, next_at: float, error: str,
                     status_code: int | None) -> None:
    await pool.execute(
        "UPDATE telemetry.webhook_deliveries SET next_attempt_at = to_timestamp($2), last_error = $3, "
        "last_status = $4 WHERE id = $1", delivery_id, next_at, error, status_code)


async def release(pool: asyncpg.Pool, delivery_id: int, next_at: float) -> None:
    """Hand back a claimed delivery that was not tried: its claim does not count as an attempt."""
    await pool.execute(
        "UPDATE telemetry.webhook_deliveries SET attempts = attempts - 1, next_attempt_at = to_timestamp($2) "
        "WHERE id = $1", delivery_id, next_at)


async def postpone_subscription(pool: asyncpg.Pool, sub_id: str, until: float) -> None:
    """Throttle: no delivery of this subscription is attempted before `until` (its receiver asked us to slow
    down), instead of hitting it with every other pending event meanwhile."""
    await pool.execute(
        "UPDATE telemetry.webhook_deliveries SET next_attempt_at = greatest(next_attempt_at, to_timestamp($2)) "
        "WHERE subscription_id = $1 AND status = 'pending'", sub_id, until)


async def mark_dead(pool: asyncpg.Pool, d: Delivery, now: float, error: str, status_code: int | None) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE telemetry.webhook_deliveries SET status = 'dead', last_error = $2, last_status = $3 "
            "WHERE id = $1", d.id, error, status_code)
        await conn.execute(
            "INSERT INTO telemetry.webhook_dead_letters(delivery_id, subscription_id, event_id, event_type, "
            "attempts, last_error, last_status, dead_at) VALUES ($1, $2, $3, $4, $5, $6, $7, to_timestamp($8)) "
            "ON CONFLICT (delivery_id) DO NOTHING",
            d.id, d.subscription_id, d.event_id, d.event_type, d.attempts, error, status_code, now)
