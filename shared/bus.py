"""JetStream streams, declared in one place, and the consumer/publish settings every service shares.

Streams are created or updated only here (`ensure_streams`), never by subscribers: FastStream's
`JStream(declare=True)` would overwrite a stream with a subscriber's partial view of it.
Everything here works on NATS 2.9 (no per-message TTL). A consumer that takes several subjects of a stream filters
on exactly those where the server takes several filters (NATS >= 2.10's `filter_subjects`), else on the stream's
pattern (`ConsumerPlan.filters`).
Names depend on the platform namespace (`shared/namespace.py`): `gpuq.job.>` in `GPUQ_JOBS` by default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from shared import namespace as namespaces
from shared.events import Payload

DUPLICATE_WINDOW_S = 120.0  # Nats-Msg-Id dedup window; the outbox relay republishes well within it
DAY_S = 86_400


@dataclass(frozen=True)
class StreamDef:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int = -1


# (name suffix, subject patterns below the namespace, retention): every namespace gets the same streams.
_STREAM_SHAPES: tuple[tuple[str, tuple[str, ...], float, int], ...] = (
    ("JOBS", ("job.>",), 30 * DAY_S, -1),
    ("PREEMPTION", ("preemption.>",), 30 * DAY_S, -1),
    ("CLUSTER", ("node.>", "queue.>"), 30 * DAY_S, -1),
    # Samples are high-rate and only needed until metering and telemetry have consumed them.
    ("UTILIZATION", ("utilization.>",), 2 * DAY_S, 8 * 1024**3),
    ("DLQ", ("dlq.>",), 90 * DAY_S, -1),
    # Audit records (AuditRecorded), kept a year on the bus for SIEMs; the audit service stores them for good.
    ("AUDIT", ("audit.>",), 365 * DAY_S, -1),
    # Status news about waiting jobs (JobPending: reasons, positions, ETAs): frequent, superseded by the next one,
    # read by telemetry, the API and webhooks only, so that no decision service wades through it.
    ("STATUS", ("status.>",), 7 * DAY_S, 4 * 1024**3),
)


def streams(namespace: str | None = None) -> tuple[StreamDef, ...]:
    """The streams of a platform namespace (default: this process's, `GPUQ_NAMESPACE`)."""
    return _streams(namespaces.validate(namespace) if namespace is not None else namespaces.current())


@lru_cache(maxsize=16)
def _streams(ns: str) -> tuple[StreamDef, ...]:
    prefix = namespaces.stream_prefix(ns)
    return tuple(StreamDef(f"{prefix}_{suffix}", tuple(f"{ns}.{p}" for p in patterns), max_age_s, max_bytes)
                 for suffix, patterns, max_age_s, max_bytes in _STREAM_SHAPES)


def dlq_subject(service: str) -> str:
    return f"{namespaces.current()}.dlq.{service}"


def matches(pattern: str, subject: str) -> bool:
    """Does NATS subject `subject` match `pattern` (with `*` and `>` wildcards)?"""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def stream_for_subject(subject: str) -> StreamDef:
    """The stream of this process's namespace that captures `subject` (LookupError: none does)."""
    ns = namespaces.current()
    found = _STREAM_OF.get((ns, subject))
    if found is None:  # subjects repeat (one per event type and team), and the relay asks twice per row: once each
        found = _stream_of(ns, subject)
        if len(_STREAM_OF) >= _STREAM_OF_MAX:  # bounded (team names come from publishers)
            _STREAM_OF.clear()
        _STREAM_OF[(ns, subject)] = found
    return found


_STREAM_OF: dict[tuple[str, str], StreamDef] = {}
_STREAM_OF_MAX = 10_000


def _stream_of(ns: str, subject: str) -> StreamDef:
    for stream in _streams(ns):
        if any(matches(p, subject) for p in stream.subjects):
            return stream
    raise LookupError(f"no stream of namespace {ns!r} captures subject {subject!r}")


# The first NATS release whose consumers take several filter subjects (`filter_subjects`, ADR-34).
MULTI_FILTER_SINCE = (2, 10)


def takes_filter_subjects(major: int, minor: int) -> bool:
    """Does a NATS server of this version take `filter_subjects` (several filters on one consumer)? (An unknown
    version, 0.0, does not: the single filter works everywhere.)"""
    return (major, minor) >= MULTI_FILTER_SINCE


@dataclass(frozen=True)
class ConsumerPlan:
    """One durable consumer a service needs: on `stream`, for the service's subscriptions (`subjects`, sorted)
    below one of the stream's subject patterns (`pattern`); its durable name ends in `suffix`."""

    stream: StreamDef
    pattern: str
    subjects: tuple[str, ...]
    suffix: str

    def filters(self, multi_filter: bool) -> tuple[str, ...]:
        """What the consumer filters on: its one subject; several: each of them where the server takes several
        filters (`multi_filter`, NATS >= 2.10), else the stream's pattern, whose other subjects the service then
        acks unread. (The subscriptions never overlap: one per event type, a scoped type's ends in its own `*`.)"""
        if len(self.subjects) == 1 or multi_filter:
            return self.subjects
        return (self.pattern,)


def consumer_plan(payload_types: Iterable[type[Payload]]) -> list[ConsumerPlan]:
    """Durable consumers a service needs: one per stream subject pattern it reads from, taking the subscriptions
    (`Payload.subscription`) of the event types it handles there."""
    wanted = sorted({cls.subscription() for cls in payload_types})
    plan: list[ConsumerPlan] = []
    ns = namespaces.current()
    for stream in streams():
        for pattern in stream.subjects:
            subjects = tuple(s for s in wanted if matches(pattern, s))
            if not subjects:
                continue
            name = pattern.removeprefix(f"{ns}.").removesuffix(".>").replace(".", "-")
            plan.append(ConsumerPlan(stream, pattern, subjects, name))
    return plan


# Every stream gpuq creates says who created it in its description ("gpuq:<purpose>"), so that a command that
# resets a namespace (the demo, a test session) can tell a platform it must never touch from its own leftovers.
# (Stream descriptions exist on NATS 2.9; stream metadata would need 2.10.)
PURPOSES = ("platform", "demo", "test", "bench")
MARKER_PREFIX = "gpuq:"


def _config(stream: StreamDef, description: str) -> StreamConfig:
    return StreamConfig(
        name=stream.name,
        description=description,
        subjects=list(stream.subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=stream.max_age_s,
        max_bytes=stream.max_bytes,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


async def ensure_streams(js: JetStreamContext, namespace: str | None = None, purpose: str = "platform") -> None:
    """Create the namespace's streams, or bring existing ones to the declared config (keeping the purpose they
    were created with). Idempotent."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown stream purpose {purpose!r}; one of {PURPOSES}")
    for stream in streams(namespace):
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(_config(stream, MARKER_PREFIX + purpose))
            except BadRequestError as exc:  # a concurrent starter created it first
                if "already in use" not in str(exc):
                    raise
            continue
        await js.update_stream(_config(stream, info.config.description or MARKER_PREFIX + purpose))


async def namespace_purposes(js: JetStreamContext, namespace: str) -> dict[str, str | None]:
    """{stream name: purpose} of the namespace's streams that exist: "platform", "demo", "test", or None for a
    stream gpuq did not mark (created by hand or by an older gpuq: treated as a platform's)."""
    found: dict[str, str | None] = {}
    for stream in streams(namespace):
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            continue
        description = info.config.description or ""
        found[stream.name] = description.removeprefix(MARKER_PREFIX) if description.startswith(MARKER_PREFIX) \
            else None
        if found[stream.name] not in PURPOSES:
            found[stream.name] = None
    return found


class NamespaceInUse(RuntimeError):
    """Refusal to delete streams that were not created for the purpose asking (e.g. a platform's, by the demo)."""


async def delete_streams(js: JetStreamContext, namespace: str, purpose: str) -> int:
    """Delete the namespace's streams, but only if every one of them was created with `purpose` (a demo resets
    only a demo's streams, a test session only its own). Returns how many were deleted."""
    found = await namespace_purposes(js, namespace)
    foreign = {name: p for name, p in found.items() if p != purpose}
    if foreign:
        owners = ", ".join(f"{name} ({p or 'unmarked: a platform'})" for name, p in sorted(foreign.items()))
        raise NamespaceInUse(
            f"namespace {namespace!r} holds streams not created by a gpuq {purpose}: {owners}; refusing to delete "
            "them. Use another namespace (GPUQ_NAMESPACE) or remove them deliberately with the NATS CLI.")
    for name in sorted(found):
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)
    return len(found)


async def connect(url: str, name: str) -> nats.NATS:
    """Connect as the user of `url` (if any), replies on that user's own inbox prefix (shared/natsauth.py)."""
    from shared.natsauth import inbox_prefix_for, redact_url

    try:
        return await nats.connect(url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
                                  allow_reconnect=True, inbox_prefix=inbox_prefix_for(url))
    except Exception as exc:  # nats raises several unrelated types for "cannot connect"
        raise ConnectionError(f"cannot connect to NATS at {redact_url(url)}: {exc}") from exc
