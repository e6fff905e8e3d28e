"""Every message a running stack publishes, held to the standards it claims: each is a CloudEvents 1.0 event the
official SDK reads, whose `data` validates against the committed schema its `dataschema` names, and each carries
W3C trace context: submissions from `gpuq submit` and from a pipeline, decisions, utilisation samples, inventory,
timers. A producer's own `traceparent` is continued, and a job's events share its trace.

The scenario is the seed's reclaim story (borrow, reclaim, checkpoint, preempt, requeue, resume) with every
service running, plus a CLI submission that is refused and a queue configuration change."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import nats
import yaml
from cloudevents.core.formats.json import JSONFormat
from nats.js.errors import NotFoundError

from services.api.readmodel import fetch_status
from services.stack import Stack, StackSettings
from shared import namespace
from shared.bus import streams
from shared.clock import ScaledClock
from shared.events import JobSubmitted, make_event, parse_event, schema_uri
from shared.schemas import schema_for_uri
from shared.servers import free_port
from shared.service import publish_event
from shared.tracing import TRACEPARENT_ENV, valid_traceparent
from tests.system.reclaim_story import BORROWER, CLUSTER, QUEUES, QUEUES_DOC, wait_until

PIPELINE_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CLI_CALLER_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
GPUQ = str(Path(sys.executable).with_name("gpuq"))
# What this scenario must produce at least (the others are covered type by type in tests/unit/contracts).
EXPECTED_TYPES = {f"io.gpuq.{t}.v1" for t in (
    "job.submitted", "job.rejected", "job.queued", "job.admitted", "job.placed", "job.started", "job.completed",
    "job.checkpoint_requested", "job.checkpointed", "job.preempted", "job.requeued", "preemption.requested",
    "utilization.sampled", "node.inventory", "queue.config_changed")}


async def gpuq(*args: str, env: dict[str, str] | None = None, exit_code: int = 0) -> str:
    proc = await asyncio.create_subprocess_exec(GPUQ, *args, env={**os.environ, **(env or {})},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == exit_code, f"gpuq {' '.join(args)} exited {proc.returncode}:\n{out.decode()}"
    return out.decode()


async def every_message(nats_url: str) -> dict[str, list[bytes]]:
    """Every message in every stream of this session's namespace, by stream."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    out: dict[str, list[bytes]] = {}
    try:
        for stream in streams(namespace.current()):
            info = await js.stream_info(stream.name)
            out[stream.name] = []
            if info.state.messages == 0:
                continue
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    out[stream.name].append((await js.get_msg(stream.name, seq)).data or b"")
                except NotFoundError:  # a sequence removed by the server (none expected here)
                    continue
    finally:
        await nc.close()
    return out


def trace_id(traceparent: str) -> str:
    return traceparent.split("-")[1]


async def test_every_published_event_is_a_valid_cloudevent_with_trace_context(fresh: tuple[str, str],
                                                                               tmp_path: Path) -> None:
    nats_url, database_url = fresh
    clock = ScaledClock(100.0)
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES,
                             cluster=CLUSTER, clock=clock, api_port=free_port())  # every service, the API too
    # The borrower must still run when team B's job arrives, after three `gpuq` commands that take seconds each on
    # a loaded machine: 6000 virtual s is a minute of wall time at 100x (the story's 2000 s left only 20 s).
    borrower = BORROWER.model_copy(update={"labels": {**BORROWER.labels, "sim.gpuq.io/duration-s": "6000"},
                                           "max_runtime_s": 12000})
    queues_file = tmp_path / "queues.yaml"
    queues_file.write_text(yaml.safe_dump(QUEUES_DOC))
    cli_env = {"NATS_URL": nats_url, "DATABASE_URL": database_url, "GPUQ_HOME": str(tmp_path / "home")}

    async def state(job_id: str) -> str:
        rows = await fetch_status(database_url, job_id)
        return rows[0]["state"] if rows else "unknown"

    async def in_state(job_id: str, wanted: str) -> bool:
        return await state(job_id) == wanted

    async with Stack(settings):
        nc = await nats.connect(nats_url)
        # A pipeline publishes with its own trace context.
        now = datetime.fromtimestamp(clock.now(), UTC)
        await publish_event(nc.jetstream(), make_event(JobSubmitted(spec=borrower, submitted_at=now),
                                                       source="ci/pipeline-7", time=now,
                                                       traceparent=PIPELINE_TRACEPARENT),
                            JobSubmitted.scoped_subject(borrower.team))
        await nc.close()
        await wait_until(lambda: in_state("a-sweep", "running"), timeout=120)
        await gpuq("apply-queues", str(queues_file), "--by", "alice", env=cli_env)
        await asyncio.sleep(1.0)  # 100 virtual seconds: past the 60 s protection window
        # The owner submits from a CI step that passes its context in TRACEPARENT; someone else, with none.
        await gpuq("submit", "--team", "team-b", "--gpus", "8", "--priority", "high", "--max-runtime", "1000",
                   "--name", "b-train", "--label", "sim.gpuq.io/duration-s=300",
                   env={**cli_env, TRACEPARENT_ENV: CLI_CALLER_TRACEPARENT})
        # refused (team B may not use team A's queue): the command says so and exits non-zero
        await gpuq("submit", "--team", "team-b", "--queue", "team-a", "--name", "intruder", env=cli_env, exit_code=1)
        await wait_until(lambda: in_state("b-train", "completed"), timeout=120)
        await wait_until(lambda: in_state("a-sweep", "completed"), timeout=240)
        assert await state("intruder") == "rejected"
        await asyncio.sleep(1.0)  # let the last outbox rows reach the bus

    messages = await every_message(nats_url)
    dlq = next(s.name for s in streams(namespace.current()) if s.name.endswith("_DLQ"))
    assert messages.pop(dlq) == [], "a service dead-lettered an event gpuq itself published"
    seen: set[str] = set()
    traces: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # job -> type -> trace ids
    submitted: dict[str, str] = {}
    total = 0
    for stream, bodies in messages.items():
        for body in bodies:
            total += 1
            event, _ = parse_event(body)  # raises, naming the problem, for anything invalid
            doc = json.loads(body)
            assert valid_traceparent(event.traceparent), f"{stream}: {event.type} {event.id} has no trace context"
            assert event.dataschema == schema_uri(event.type)
            jsonschema.validate(doc["data"], schema_for_uri(event.dataschema))
            sdk_event = JSONFormat().read(None, body)
            assert (sdk_event.get_id(), sdk_event.get_type()) == (event.id, event.type)
            seen.add(event.type)
            if event.subject:
                traces[event.subject][event.type].add(trace_id(event.traceparent or ""))
                if event.type == "io.gpuq.job.submitted.v1":
                    submitted[event.subject] = event.traceparent or ""
    missing = EXPECTED_TYPES - seen
    assert not missing, f"the scenario produced no {sorted(missing)}"
    assert total >= 30

    # The pipeline's own traceparent is kept as it is, and the job's life continues its trace.
    assert submitted["a-sweep"] == PIPELINE_TRACEPARENT
    for event_type in ("io.gpuq.job.admitted.v1", "io.gpuq.job.placed.v1", "io.gpuq.job.started.v1",
                       "io.gpuq.job.completed.v1"):
        assert traces["a-sweep"][event_type] == {trace_id(PIPELINE_TRACEPARENT)}, event_type
    # `gpuq submit` continues its caller's TRACEPARENT: same trace, its own span.
    assert trace_id(submitted["b-train"]) == trace_id(CLI_CALLER_TRACEPARENT)
    assert submitted["b-train"] != CLI_CALLER_TRACEPARENT
    assert traces["b-train"]["io.gpuq.job.completed.v1"] == {trace_id(CLI_CALLER_TRACEPARENT)}
    # Without a caller's context the submission starts the job's trace, and the refusal belongs to it.
    assert traces["intruder"]["io.gpuq.job.rejected.v1"] == {trace_id(submitted["intruder"])}
