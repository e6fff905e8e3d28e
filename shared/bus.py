"""JetStream streams, declared in one place, and the consumer/publish settings every service shares.

Streams are created or updated only here (`ensure_streams`), never by subscribers: FastStream's
`JStream(declare=True)` would overwrite a stream with a subscriber's partial view of it.
Everything here works on NATS 2.9 (no per-message TTL). A consumer that takes several subjects of a stream filters
on exactly those where the server takes several filters (NATS >= 2.10's `filter_subjects`), else on the stream's
pattern (`ConsumerPlan.filters`).
Names depend on the platform namespace (`shared/namespace.py`): `gpuq.job.>` in `GPUQ_JOBS` by default.

Every stream is bounded (docs/events.md, "Streams and their limits"): by age and by bytes. A stream of facts (jobs,
preemptions, the cluster's nodes and configuration) refuses a publish when full (discard new: the publisher is
told, `maximum bytes exceeded`, and an outbox relay retries it later) rather than silently dropping old facts that
a consumer may not have read yet; streams whose old messages are superseded or kept elsewhere (utilisation
samples, status news, dead letters and audit records, which their services store in Postgres) drop their oldest.
Each service declares and may create the streams it uses; only a stream's owner (and admins) may update one
(shared/busroles.py says which, shared/natsauth.py grants exactly that).

On a NATS cluster every stream is kept on `GPUQ_STREAM_REPLICAS` servers (default 1; 3 survives the loss of a
server; the chart sets it from its values). gpuq never lowers what an operator raised: a stream found with more
replicas, a higher byte limit, or a higher age limit or none, keeps it (`kept_config`), and the log says what was
kept; a stream without a byte limit is bounded all the same.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shared import namespace as namespaces
from shared.busroles import inbox_prefix_for, redact_url, stream_rights
from shared.busroles import matches as matches  # (bus.matches, as before)
from shared.events import Payload

log = logging.getLogger("gpuq.bus")
DUPLICATE_WINDOW_S = 120.0  # Nats-Msg-Id dedup window; the outbox relay republishes well within it
DAY_S = 86_400


GIB = 1024**3


@dataclass(frozen=True)
class StreamDef:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int = -1
    # NEW: a full stream refuses the publish (the publisher hears why); OLD: it drops its oldest messages.
    discard: DiscardPolicy = DiscardPolicy.NEW
    owner: str = ""  # the one service that may update the stream's configuration (besides admins)
    replicas: int = 1  # servers of a NATS cluster that keep a copy (GPUQ_STREAM_REPLICAS)


@dataclass(frozen=True)
class _Shape:
    suffix: str
    patterns: tuple[str, ...]  # subject patterns below the namespace
    max_age_s: float
    max_bytes: int
    discard: DiscardPolicy
    owner: str


MIB = 1024**2

# Every namespace gets the same streams. JetStream reserves each stream's byte limit on the server's store when the
# stream is created or updated, so the defaults (12 GiB in all, as much as before every stream was bounded) fit the
# 20 GiB store docs/install.md sizes; a platform with more jobs gives its streams more with GPUQ_STREAM_MAX_BYTES
# (`byte_limits`), e.g. JOBS=64Gi, and its JetStream the storage for them.
_STREAM_SHAPES: tuple[_Shape, ...] = (
    # Facts: refused when full, never dropped unread (a consumer that was down still gets every one). The outbox
    # relay retries a refused fact until the oldest age out: the platform stalls rather than forgets. About 10 KB
    # per job: 3 GiB keeps 30 days of some 300,000 jobs.
    _Shape("JOBS", ("job.>",), 30 * DAY_S, 3 * GIB, DiscardPolicy.NEW, "admission"),
    _Shape("PREEMPTION", ("preemption.>",), 30 * DAY_S, 256 * MIB, DiscardPolicy.NEW, "preemption"),
    _Shape("CLUSTER", ("node.>", "queue.>"), 30 * DAY_S, GIB, DiscardPolicy.NEW, "scheduler"),
    # Samples are high-rate and only needed until metering and telemetry have consumed them (metering's ledger is
    # the record); refusing them when full would stall the executors' outboxes, job facts included.
    _Shape("UTILIZATION", ("utilization.>",), 2 * DAY_S, 6 * GIB, DiscardPolicy.OLD, "metering"),
    # Dead letters are also kept in each service's `dead_letters` table: the stream is their notice.
    _Shape("DLQ", ("dlq.>",), 90 * DAY_S, 256 * MIB, DiscardPolicy.OLD, "audit"),
    # Audit records (AuditRecorded), kept up to a year on the bus for SIEMs; the audit service stores them for good,
    # so a full stream drops the oldest rather than stopping every service's outbox behind a year of records.
    _Shape("AUDIT", ("audit.>",), 365 * DAY_S, 512 * MIB, DiscardPolicy.OLD, "audit"),
    # Status news about waiting jobs (JobPending: reasons, positions, ETAs): frequent, superseded by the next one,
    # read by telemetry, the API and webhooks only, so that no decision service wades through it.
    _Shape("STATUS", ("status.>",), 7 * DAY_S, GIB, DiscardPolicy.OLD, "admission"),
)
LIMITS_ENV = "GPUQ_STREAM_MAX_BYTES"
_UNITS = {"": 1, "k": 1000, "ki": 1024, "m": 1000**2, "mi": MIB, "g": 1000**3, "gi": GIB, "t": 1000**4, "ti": 1024**4}


def byte_limits(text: str) -> dict[str, int]:
    """Per-stream byte limits from `GPUQ_STREAM_MAX_BYTES`: `JOBS=64Gi,AUDIT=8Gi` (stream name suffixes; sizes in
    bytes or with k, Ki, M, Mi, G, Gi, T, Ti). ValueError names what is wrong."""
    out: dict[str, int] = {}
    known = {s.suffix for s in _STREAM_SHAPES}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, size = part.partition("=")
        name = name.strip().upper()
        digits = size.strip().rstrip("BbIiKkMmGgTt")
        unit = size.strip()[len(digits):].lower().removesuffix("b")
        if name not in known or not digits.isdigit() or unit not in _UNITS or int(digits) < 1:
            raise ValueError(f"{LIMITS_ENV}: {part!r} is not <stream>=<size>, a stream of "
                             f"{', '.join(sorted(known))} and a size such as 8Gi")
        out[name] = int(digits) * _UNITS[unit]
    return out


REPLICAS_ENV = "GPUQ_STREAM_REPLICAS"
MAX_REPLICAS = 5  # JetStream's own limit


def replicas_of(text: str) -> int:
    """The streams' replica count from `GPUQ_STREAM_REPLICAS` (empty: 1). ValueError names what is wrong."""
    raw = text.strip()
    if not raw:
        return 1
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_REPLICAS:
        raise ValueError(f"{REPLICAS_ENV}={text!r} must be a whole number from 1 to {MAX_REPLICAS} (3 on a NATS "
                         "cluster of 3 servers or more, 1 on a single server)")
    return int(raw)


def streams(namespace: str | None = None) -> tuple[StreamDef, ...]:
    """The streams of a platform namespace (default: this process's, `GPUQ_NAMESPACE`), with their byte limits as
    `GPUQ_STREAM_MAX_BYTES` sets them and their replicas as `GPUQ_STREAM_REPLICAS` does."""
    ns = namespaces.validate(namespace) if namespace is not None else namespaces.current()
    from shared.settings import settings  # here: CLI commands import the bus, and this module costs them ~65 ms

    given = settings()
    return _streams(ns, given.stream_max_bytes, str(given.stream_replicas))


@lru_cache(maxsize=16)
def _streams(ns: str, limits: str, replicas: str = "") -> tuple[StreamDef, ...]:
    prefix = namespaces.stream_prefix(ns)
    sizes = byte_limits(limits)
    copies = replicas_of(replicas)
    return tuple(StreamDef(f"{prefix}_{s.suffix}", tuple(f"{ns}.{p}" for p in s.patterns), s.max_age_s,
                           sizes.get(s.suffix, s.max_bytes), s.discard, s.owner, copies)
                 for s in _STREAM_SHAPES)


def pattern_name(pattern: str) -> str:
    """A stream subject pattern's name in durable consumer names: `job.>` -> `job` (below the namespace)."""
    return pattern.removesuffix(".>").replace(".", "-")


def dlq_subject(service: str) -> str:
    return f"{namespaces.current()}.dlq.{service}"


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
    for stream in streams(ns):
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
            name = pattern_name(pattern.removeprefix(f"{ns}."))
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
        discard=stream.discard,
        duplicate_window=DUPLICATE_WINDOW_S,
        num_replicas=stream.replicas,
    )


def _roomier(have: float | None, declared: float | None, *, none_kept: bool) -> bool:
    """Does an existing limit give more room than the declared one? None, 0 and -1 are JetStream's "no limit", which
    counts as more room only where `none_kept`."""
    if declared is None or declared <= 0:
        return False  # the declaration sets no limit: nothing gives more room
    if have is None or have <= 0:
        return none_kept
    return have > declared


def kept_config(have: StreamConfig, declared: StreamConfig) -> tuple[StreamConfig, list[str]]:
    """The configuration to bring an existing stream to: the declared one, except where an operator gave the stream
    more than declared: more replicas, a higher byte limit, a higher age limit or none; returns it and what was kept.
    A stream without a byte limit is bounded all the same (every stream is: a producer must not be able to fill the
    server's store; an older gpuq created them unbounded). The settings gpuq does not declare (message counts and
    sizes, placement...) stay as the stream has them."""
    kept: list[str] = []
    fields: dict[str, Any] = {}
    if (have.num_replicas or 1) > (declared.num_replicas or 1):
        fields["num_replicas"] = have.num_replicas
        kept.append(f"{have.num_replicas} replicas (declared {declared.num_replicas})")
    if _roomier(have.max_bytes, declared.max_bytes, none_kept=False):
        fields["max_bytes"] = have.max_bytes
        kept.append(f"max_bytes {_limit(have.max_bytes)} (declared {declared.max_bytes})")
    if _roomier(have.max_age, declared.max_age, none_kept=True):
        fields["max_age"] = have.max_age
        kept.append(f"max_age {_limit(have.max_age, 's')} (declared {declared.max_age:g} s)")
    wanted = replace(have, **{**{name: getattr(declared, name) for name in _DECLARED}, **fields})
    return wanted, kept


# What gpuq declares of a stream; the rest of an existing stream's configuration is left as it is.
_DECLARED = ("description", "subjects", "retention", "storage", "max_age", "max_bytes", "discard", "duplicate_window",
             "num_replicas")


def _limit(value: float | None, unit: str = "") -> str:
    """A limit as the log shows it: "none", bytes whole, seconds as given."""
    if value is None or value <= 0:
        return "none"
    return f"{value:g} {unit}" if unit else str(int(value))


def differences(have: StreamConfig, want: StreamConfig) -> list[str]:
    """What an existing stream's configuration has other than declared (the description, its purpose, aside)."""
    out: list[str] = []
    if (have.num_replicas or 1) != (want.num_replicas or 1):
        out.append(f"num_replicas {have.num_replicas or 1} (declared {want.num_replicas or 1})")
    for name in ("retention", "storage", "discard", "max_bytes", "max_age", "duplicate_window"):
        got, wanted = getattr(have, name), getattr(want, name)
        same = abs(float(got or 0) - float(wanted or 0)) < 1e-3 if name in ("max_age", "duplicate_window") \
            else got == wanted
        if not same:
            out.append(f"{name} {got} (declared {wanted})")
    if sorted(have.subjects or ()) != sorted(want.subjects or ()):
        out.append(f"subjects {have.subjects} (declared {want.subjects})")
    return out


async def ensure_streams(js: JetStreamContext, namespace: str | None = None, purpose: str = "platform") -> None:
    """Create the namespace's streams, or bring existing ones to the declared config (keeping the purpose they
    were created with). Idempotent.

    On an authenticated server a service's bus user declares only the streams it uses and updates only those it
    owns (shared/busroles.py): it creates one that is missing, leaves one that matches its declaration alone, and
    logs, without failing, one that differs and is another service's to update (its owner brings it up to date
    when it starts)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown stream purpose {purpose!r}; one of {PURPOSES}")
    ns = namespaces.validate(namespace) if namespace is not None else namespaces.current()
    user = connection_user(js)
    for stream in streams(ns):
        rights = stream_rights(user, ns, stream)
        if rights is None:
            continue  # a stream this user does not use: another service declares it
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(_config(stream, MARKER_PREFIX + purpose))
            except BadRequestError as exc:  # a concurrent starter created it first
                if "already in use" not in str(exc):
                    raise
            except APIError as exc:
                if exc.err_code == NOT_CLUSTERED:
                    raise RuntimeError(f"cannot create stream {stream.name}: {_not_clustered(stream)}") from exc
                if exc.err_code != NO_STORAGE:
                    raise
                raise RuntimeError(f"cannot create stream {stream.name}: {_no_storage(stream)}") from exc
            continue
        wanted, kept = kept_config(info.config, _config(stream, info.config.description or MARKER_PREFIX + purpose))
        if kept:
            log.info("stream %s keeps what it was given above its declaration: %s (gpuq never lowers a stream's "
                     "replicas or limits; lower them with the NATS CLI and %s / %s)", stream.name, "; ".join(kept),
                     REPLICAS_ENV, LIMITS_ENV)
        changed = differences(info.config, wanted)
        if not changed:
            continue
        if rights == "update":
            log.info("stream %s brought to its declaration: %s", stream.name, "; ".join(changed))
            try:
                await js.update_stream(wanted)
            except APIError as exc:
                if exc.err_code == NOT_CLUSTERED:
                    raise RuntimeError(f"cannot update stream {stream.name}: {_not_clustered(stream)}") from exc
                if exc.err_code != NO_STORAGE:
                    raise
                # It keeps working as it was: not a reason to stop the service, but said where operators look.
                log.error("stream %s keeps its old limits: %s", stream.name, _no_storage(stream))
        else:
            log.warning("stream %s differs from its declaration (%s); the %s service (its owner) or an admin updates "
                        "it", stream.name, "; ".join(changed), stream.owner)


NO_STORAGE = 10047  # JetStream: "insufficient storage resources available" (limits are reserved on the store)
NOT_CLUSTERED = 10074  # JetStream: "replicas > 1 not supported in non-clustered mode"


def _not_clustered(stream: StreamDef) -> str:
    return (f"{REPLICAS_ENV} asks for {stream.replicas} replicas, and this NATS server is not part of a cluster; "
            f"set {REPLICAS_ENV}=1 (the chart: streams.natsClustered=false), or point gpuq at a NATS cluster")


def _no_storage(stream: StreamDef) -> str:
    return (f"the server's JetStream store cannot reserve its {stream.max_bytes} bytes besides the other streams'; "
            f"give JetStream more storage (max_file_store), or the streams less with {LIMITS_ENV} "
            "(docs/install.md, Sizing)")


def connection_user(js: JetStreamContext) -> str | None:
    """The bus user a JetStream context's connection authenticated as (None: none, or not known)."""
    nc = getattr(js, "_nc", None)  # nats-py keeps its connection there and offers no public accessor
    url = getattr(nc, "connected_url", None)
    username = getattr(url, "username", None)
    return unquote(username) if username else None


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
    """Connect as the user of `url` (if any), replies on that user's own inbox prefix (shared/busroles.py)."""
    try:
        return await nats.connect(url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
                                  allow_reconnect=True, inbox_prefix=inbox_prefix_for(url))
    except Exception as exc:  # nats raises several unrelated types for "cannot connect"
        raise ConnectionError(f"cannot connect to NATS at {redact_url(url)}: {exc}") from exc
