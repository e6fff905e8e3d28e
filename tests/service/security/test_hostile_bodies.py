"""Hostile bodies at every consumer of a running platform (issue 43), drawn by Hypothesis: deep nesting, huge and
unstorable strings (NUL, lone surrogates), wrong types, random bytes, and valid-looking envelopes with bad data or a
bad attribute, each published on a subject some service consumes. For every one:

- every service that consumes the subject dead-letters it, once, with a reason that says it could not be read (it
  never reaches a handler, never fails one, never is retried);
- a canary submitted after it is still admitted (no consumer stopped or fell behind);
- /readyz tells the truth: ready, every consumer advancing.

Every body is built to be invalid whatever is drawn (a NUL, a surrogate or an oversized string is planted in it, or
its nesting, an attribute or its bytes cannot make an event), so that "dead-lettered" is the only right outcome."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import nats
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from services.stack import Stack, StackSettings
from shared.clock import ScaledClock
from shared.config import parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import CATALOGUE, MAX_DEPTH, JobSubmitted, Payload, encode_event, make_event
from shared.health import HealthServer
from shared.service import ServiceRuntime
from tests.conftest import reset_bus
from tests.service.security.test_attacks import CLUSTER

SERVICES = ("admission", "scheduler", "preemption", "metering", "telemetry", "executor", "audit")
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    # Quota far above the cluster: a canary is admitted whatever the earlier canaries hold.
    "queues": [{"name": team, "teams": [team], "quotas": {"H100-80GB": {"nominal": 100_000}}}
               for team in ("team-a", "team-b")]})
# What a body that cannot be read is dead-lettered with (docs/events.md, "Dead letters"); never HandlerFailed or
# Unstorable, which would mean it reached a handler.
UNREADABLE = {"MalformedJson", "MalformedEnvelope", "UnsupportedSpecVersion", "UnknownEventType", "InvalidPayload",
              "TooDeep", "TooLarge", "Unreadable"}
CANARIES = itertools.count()


@dataclass(frozen=True)
class Target:
    subject: str
    kind: type[Payload]
    consumers: tuple[ServiceRuntime, ...]  # the services that consume the subject


@dataclass
class Platform:
    stack: Stack
    nc: Client
    conn: asyncpg.Connection
    readyz: str
    targets: tuple[Target, ...]


def _concrete(kind: type[Payload]) -> str:
    """A subject `kind` travels on: a scoped one with the attacking team's (or a service's) token."""
    return kind.scoped_subject("team-b" if kind.scope == "team" else "admission") if kind.scope else kind.subject()


def _targets(runtimes: list[ServiceRuntime]) -> tuple[Target, ...]:
    found = []
    for kind in CATALOGUE:
        subject = _concrete(kind)
        consumers = tuple(r for r in runtimes if r.routed(subject) or kind in r.spec.batch_handlers)
        if consumers:
            found.append(Target(subject, kind, consumers))
    return tuple(found)


@pytest_asyncio.fixture(scope="module")
async def platform(nats_url: str, make_database: Callable[[str], Awaitable[str]]) -> AsyncIterator[Platform]:
    await reset_bus(nats_url)
    database_url = await make_database("hostile")
    stack = Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                                services=SERVICES, clock=ScaledClock(100.0)))
    await stack.start()
    for runtime in stack.runtimes:
        runtime.stall_after_s = 5.0  # a consumer that stopped or fell behind would show within the test's waits
    nc = await nats.connect(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        async with HealthServer(stack.health, host="127.0.0.1", port=0) as health:
            targets = _targets(stack.runtimes)
            assert {s for t in targets for s in (r.spec.name for r in t.consumers)} == set(SERVICES)
            yield Platform(stack, nc, conn, f"http://127.0.0.1:{health.bound_port}/readyz", targets)
    finally:
        await conn.close()
        await nc.close()
        await stack.stop()


# ------------------------------------------------------------------------------ the bodies

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
    st.text(max_size=12)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) |
                     st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
# A string Postgres cannot store: somewhere in it a NUL or a lone surrogate; sometimes in a huge string (the body
# stays within NATS's 1 MiB).
_UNSTORABLE = st.builds(lambda a, bad, b, pad: a + bad + b + "x" * pad, st.text(max_size=6),
                        st.sampled_from(["\u0000", "\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=6),
                        st.sampled_from([0, 0, 0, 70_000, 400_000]))


@st.composite
def _planted(draw: st.DrawFn, around: Any = None) -> dict[str, Any]:
    """A JSON object with an unstorable string somewhere in it (a value or a key, at some depth)."""
    bad: Any = draw(_UNSTORABLE)
    if draw(st.booleans()):
        bad = {bad: draw(_JSON)}  # as a key
    for wrap in draw(st.lists(st.sampled_from(["list", "dict"]), max_size=4)):
        bad = [bad] if wrap == "list" else {draw(st.text(max_size=6)): bad}
    doc = dict(around) if isinstance(around, dict) else draw(st.dictionaries(st.text(max_size=8), _JSON, max_size=3))
    doc[draw(st.text(max_size=8))] = bad
    return doc


def _envelope(kind: type[Payload], data: Any) -> dict[str, Any]:
    return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "mallory", "type": kind.event_type(),
            "time": "2026-01-01T00:00:00Z", "datacontenttype": "application/json", "data": data}


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()  # ASCII: NULs and surrogates as \u escapes, as a producer in any language writes


@st.composite
def deep(draw: st.DrawFn, kind: type[Payload]) -> bytes:
    depth = draw(st.integers(MAX_DEPTH + 1, 3000))
    shape = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('[{"a":', "}]")]))
    times = depth if shape[0] != '[{"a":' else depth // 2 + 1
    nested = shape[0] * times + "1" + shape[1] * times
    where = draw(st.sampled_from(["bare", "data", "extension"]))
    if where == "bare":
        return nested.encode()
    envelope = _dumps(_envelope(kind, {"x": "PLACE"} if where == "data" else {}))
    if where == "extension":
        envelope = envelope[:-1] + b', "ext": "PLACE"}'
    return envelope.replace(b'"PLACE"', nested.encode())


@st.composite
def bad_data(draw: st.DrawFn, kind: type[Payload]) -> bytes:
    """A valid envelope of the subject's own type whose data cannot be read: unstorable strings planted in it,
    wrong types, or no object at all."""
    data = draw(st.one_of(
        _planted(),
        st.builds(lambda f, v: {f: v}, st.sampled_from(sorted(n for n, f in kind.model_fields.items()
                                                            if f.is_required())), _JSON).flatmap(_planted),
        st.just({}),  # every type has a required field
        st.lists(_JSON, max_size=3) | _SCALARS))  # not an object
    return _dumps(_envelope(kind, data))


@st.composite
def bad_envelope(draw: st.DrawFn, kind: type[Payload]) -> bytes:
    doc = _envelope(kind, draw(_planted() | st.just({})))
    attribute, value = draw(st.sampled_from([
        ("time", st.integers() | st.sampled_from(["2026-11-30 12:00", "2026-11-30T12:00:00", "yesterday"])),
        ("specversion", st.sampled_from(["0.3", "2.0", 1, None, ""])),
        ("type", st.text(max_size=20).map(lambda t: "io.gpuq.nothing." + t)),
        ("id", st.sampled_from(["", None]) | st.integers() | st.text(min_size=1).map(lambda t: t * 300)),
        ("source", st.sampled_from([None, "", "has space"]) | st.lists(_SCALARS, max_size=2)),
        ("subject", _UNSTORABLE | st.just("")),
        ("data_base64", st.text(max_size=8)),
        ("Bad_Ext", st.text(max_size=8)),
    ]).flatmap(lambda pair: st.tuples(st.just(pair[0]), pair[1])))
    if value is None:
        doc.pop(attribute, None)
    else:
        doc[attribute] = value
    return _dumps(doc)


def bodies(kind: type[Payload]) -> st.SearchStrategy[bytes]:
    return st.one_of(deep(kind), bad_data(kind), bad_envelope(kind),
                     st.binary(max_size=1024),  # random bytes
                     _SCALARS.map(_dumps))


# ------------------------------------------------------------------------------ the checks


async def _eventually(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _dead_lettered(p: Platform, target: Target, seq: int) -> list[tuple[str, str, int]] | None:
    found = []
    for runtime in target.consumers:
        rows = await p.conn.fetch(f"SELECT reason, deliveries FROM {runtime.spec.schema}.dead_letters "
                                  "WHERE stream_seq = $1 AND subject = $2", seq, target.subject)
        if not rows:
            return None
        found += [(runtime.spec.name, r["reason"], r["deliveries"]) for r in rows]
    return found


def _canary() -> bytes:
    job_id = f"canary-{next(CANARIES)}"
    spec = JobSpec(job_id=job_id, team="team-a", queue="team-a", pod_sets=(PodSet(gpus_per_pod=1),),
                   labels={"sim.gpuq.io/duration-s": "1"})
    return encode_event(make_event(JobSubmitted(spec=spec), source="pipeline", time=datetime.now(UTC)))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_every_consumer_dead_letters_a_hostile_body_and_goes_on(platform: Platform, data: st.DataObject) -> None:
    p = platform
    js = p.nc.jetstream()
    target = data.draw(st.sampled_from(p.targets), label="target")
    body = data.draw(bodies(target.kind), label="body")
    seq = (await js.publish(target.subject, body)).seq
    rows = await _eventually(lambda: _dead_lettered(p, target, seq), f"every consumer of {target.subject} to "
                             f"dead-letter {body[:80]!r}")
    assert len(rows) == len(target.consumers), rows  # once each
    for service, reason, deliveries in rows:
        assert reason in UNREADABLE and deliveries == 1, (service, reason, deliveries, body[:200])

    canary = _canary()
    await js.publish(JobSubmitted.scoped_subject("team-a"), canary)
    job_id = json.loads(canary)["data"]["spec"]["job_id"]
    await _eventually(lambda: p.conn.fetchval("SELECT status IN ('admitted', 'finished') FROM admission.jobs "
                                              "WHERE job_id = $1", job_id), f"{job_id} admitted")

    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(p.readyz)
    report = response.json()
    assert response.status_code == 200 and report["ready"], report
    for name in SERVICES:
        service = report["services"][name]
        assert service["checks"]["consumers"]["ok"], service
        assert not any(c["stalled"] for c in service["consumers"]), service
