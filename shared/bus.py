"""JetStream streams, declared in one place, and the consumer/publish settings every service shares.

Streams are created or updated only here (`ensure_streams`), never by subscribers: FastStream's
`JStream(declare=True)` would overwrite a stream with a subscriber's partial view of it.
Everything here works on NATS 2.9 (no per-message TTL, one filter subject per consumer).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from shared.events import Payload

DLQ_SUBJECT_PREFIX = "gpuq.dlq."
DUPLICATE_WINDOW_S = 120.0  # Nats-Msg-Id dedup window; the outbox relay republishes well within it
DAY_S = 86_400


@dataclass(frozen=True)
class StreamDef:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float
    max_bytes: int = -1


STREAMS: tuple[StreamDef, ...] = (
    StreamDef("GPUQ_JOBS", ("gpuq.job.>",), max_age_s=30 * DAY_S),
    StreamDef("GPUQ_PREEMPTION", ("gpuq.preemption.>",), max_age_s=30 * DAY_S),
    StreamDef("GPUQ_CLUSTER", ("gpuq.node.>", "gpuq.queue.>"), max_age_s=30 * DAY_S),
    # Samples are high-rate and only needed until metering and telemetry have consumed them.
    StreamDef("GPUQ_UTILIZATION", ("gpuq.utilization.>",), max_age_s=2 * DAY_S, max_bytes=8 * 1024**3),
    StreamDef("GPUQ_DLQ", ("gpuq.dlq.>",), max_age_s=90 * DAY_S),
)


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def stream_for_subject(subject: str) -> StreamDef:
    for stream in STREAMS:
        if any(_matches(p, subject) for p in stream.subjects):
            return stream
    raise LookupError(f"no stream captures subject {subject!r}")


def consumer_plan(payload_types: Iterable[type[Payload]]) -> list[tuple[StreamDef, str, str]]:
    """Durable consumers a service needs: (stream, filter subject, durable-name suffix).

    One consumer per stream subject pattern the service reads from: the exact subject when it handles one
    event type there, else the pattern itself (NATS 2.9 allows a single filter per consumer). Events in a
    wider filter that the service does not handle are acked without work."""
    wanted = sorted({cls.subject() for cls in payload_types})
    plan: list[tuple[StreamDef, str, str]] = []
    for stream in STREAMS:
        for pattern in stream.subjects:
            subjects = [s for s in wanted if _matches(pattern, s)]
            if not subjects:
                continue
            name = pattern.removeprefix("gpuq.").removesuffix(".>").replace(".", "-")
            plan.append((stream, subjects[0] if len(subjects) == 1 else pattern, name))
    return plan


def _config(stream: StreamDef) -> StreamConfig:
    return StreamConfig(
        name=stream.name,
        subjects=list(stream.subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=stream.max_age_s,
        max_bytes=stream.max_bytes,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


async def ensure_streams(js: JetStreamContext) -> None:
    """Create the streams, or bring existing ones to the declared config. Idempotent."""
    for stream in STREAMS:
        config = _config(stream)
        try:
            await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError as exc:  # a concurrent starter created it first
                if "already in use" not in str(exc):
                    raise
            continue
        await js.update_stream(config)


async def connect(url: str, name: str) -> nats.NATS:
    try:
        return await nats.connect(url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
                                  allow_reconnect=True)
    except Exception as exc:  # nats raises several unrelated types for "cannot connect"
        raise ConnectionError(f"cannot connect to NATS at {url}: {exc}") from exc
