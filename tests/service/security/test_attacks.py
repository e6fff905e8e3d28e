"""Each attack of issue 14's "What was seen", replayed against a running platform on a real nats-server started
with the bus users' configuration: every one now fails to do harm.

The attacker holds team-b's producer credential (the most any user of the bus holds). A second layer is tested
too: what the services do with forged events that a server without authentication would let through."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from services.stack import Stack, StackSettings
from shared.bus import stream_for_subject
from shared.clock import ScaledClock
from shared.config import parse_cluster, parse_queues
from shared.domain import GpuBinding, JobSpec, PodSet
from shared.events import (
    JobAdmitted,
    JobCancelled,
    JobCancelRequested,
    JobCompleted,
    JobPlaced,
    JobSubmitted,
    Payload,
    QueueConfigChanged,
    encode_event,
    make_event,
)
from shared.natsauth import ADMIN, SERVICES
from shared.service import publish_event
from tests.service.security.conftest import AuthServer, reset_streams, wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CLUSTER = parse_cluster({"node_groups": [{"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100-80GB",
                                          "cpu_milli": 96000, "memory_mib": 1_000_000, "nodes_per_rack": 2}]},
                        "test cluster")
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}, {"name": "production", "value": 1000,
                                                             "preemptible": False}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
               {"name": "team-b", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}}],
    "governance": {"teams": {"team-a": {"max_gpus_per_job": 8, "allowed_datasets": ["imagenet*"],
                                        "approval_required_classes": ["production"]}}},
}, "test queues")
SPEED = 100.0


def job(job_id: str, team: str = "team-a", gpus: int = 8, duration_s: int = 60, **extra: object) -> JobSpec:
    return JobSpec(job_id=job_id, team=team, queue=team, pod_sets=(PodSet(count=1, gpus_per_pod=gpus),),
                   max_runtime_s=100_000, labels={"sim.gpuq.io/duration-s": str(duration_s)}, **extra)  # type: ignore[arg-type]  # test-only fields


async def publish(js: JetStreamContext, payload: Payload, subject: str, at: datetime = T0) -> None:
    await publish_event(js, make_event(payload, source="test", time=at), subject)


async def refused(js: JetStreamContext, errors: list[Exception], payload: Payload, subject: str) -> None:
    """The server refuses the publish: no acknowledgement, a permissions violation reported."""
    with pytest.raises(TimeoutError):
        await js.publish(subject, encode_event(make_event(payload, source="mallory", time=T0)), timeout=1.0)
    await wait_for(lambda: _async(any("ermissions" in str(e) and subject.lower() in str(e).lower() for e in errors)),
                   what=f"a permissions violation for {subject}")


async def _async(value: object) -> object:
    return value


# ------------------------------------------------------------------------------ the server refuses


async def test_a_team_credential_publishes_only_its_own_submissions_and_cancel_requests(
        auth_server: AuthServer, admin_js: JetStreamContext) -> None:
    await reset_streams(auth_server.admin_url)
    nc, js, errors = await auth_server.connect("producer-team-b")
    try:
        before = (await admin_js.stream_info(stream_for_subject(JobSubmitted.subject()).name)).state.messages
        # Allowed: its own team's subjects.
        await publish(js, JobSubmitted(spec=job("b-1", team="team-b")), JobSubmitted.scoped_subject("team-b"))
        await publish(js, JobCancelRequested(job_id="b-1"), JobCancelRequested.scoped_subject("team-b"))
        # Refused: everything internal, and another team's subjects.
        placed = JobPlaced(job_id="ghost", spec=job("ghost", team="team-b"), placed_at=T0, fencing_token=99,
                           bindings=(GpuBinding(pod="main-0", node="h100-0", gpu_indices=tuple(range(8))),))
        await refused(js, errors, placed, JobPlaced.subject())
        await refused(js, errors, JobCompleted(job_id="a-1", finished_at=T0), JobCompleted.subject())
        await refused(js, errors, JobCancelled(job_id="a-1", by="mallory"), JobCancelled.subject())
        await refused(js, errors, QueueConfigChanged(config=QUEUES.model_dump(mode="json"), changed_by="mallory"),
                      QueueConfigChanged.subject())
        await refused(js, errors, JobSubmitted(spec=job("a-evil")), JobSubmitted.scoped_subject("team-a"))
        await refused(js, errors, JobCancelRequested(job_id="a-1"), JobCancelRequested.scoped_subject("team-a"))
        after = (await admin_js.stream_info(stream_for_subject(JobSubmitted.subject()).name)).state.messages
        assert after - before == 2  # only the two allowed events reached the stream
    finally:
        await nc.close()


async def test_a_team_credential_cannot_read_other_clients_deliveries(auth_server: AuthServer) -> None:
    nc, _, errors = await auth_server.connect("producer-team-b")
    try:
        for subject in (">", "_INBOX.>", f"{JobSubmitted.subject()}.*", "_INBOX_admission.>"):
            await nc.subscribe(subject)
            await wait_for(lambda s=subject: _async(any(s.lower() in str(e).lower() for e in errors)),  # type: ignore[misc]
                           what=f"a refused subscription to {subject}")
    finally:
        await nc.close()


async def test_each_service_publishes_only_the_facts_it_owns(auth_server: AuthServer) -> None:
    owners = {JobPlaced: "scheduler", JobCompleted: "executor", JobCancelled: "admission"}
    for cls, owner in owners.items():
        for user in SERVICES:
            if user == owner or (user == "api" and cls is QueueConfigChanged):
                continue
            nc, js, errors = await auth_server.connect(user)
            try:
                with pytest.raises(TimeoutError):
                    await js.publish(cls.subject(), b"{}", timeout=0.5)
                assert any("ermissions" in str(e) for e in errors), (user, cls.__name__)
            finally:
                await nc.close()


# ------------------------------------------------------------------------------ the services refuse


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]
                   ) -> AsyncIterator[tuple[Stack, asyncpg.Connection]]:
    """admission, scheduler, executor and audit, each on its own bus credential, on fresh streams and database."""
    await reset_streams(auth_server.admin_url)
    database_url = await make_database("security")
    settings = StackSettings(nats_url=auth_server.admin_url, database_url=database_url, queues=QUEUES,
                             cluster=CLUSTER, services=("admission", "scheduler", "executor", "audit"),
                             clock=ScaledClock(SPEED), nats_urls={s: auth_server.url(s) for s in SERVICES})
    async with Stack(settings) as stack:
        conn = await asyncpg.connect(database_url)
        try:
            yield stack, conn
        finally:
            await conn.close()


async def status(conn: asyncpg.Connection, job_id: str) -> tuple[str, str | None] | None:
    row = await conn.fetchrow("SELECT status, outcome FROM admission.jobs WHERE job_id = $1", job_id)
    return (row["status"], row["outcome"]) if row else None


async def test_a_forged_cancel_from_another_team_cancels_nothing(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection]) -> None:
    _, conn = platform
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        await publish(js_a, JobSubmitted(spec=job("a-long", duration_s=36_000)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT status = 'running' FROM executor.runs WHERE job_id = 'a-long'"),
                       what="team-a's job running")
        # mallory (team-b) asks to cancel team-a's job on the only cancel subject team-b may publish on.
        await publish(js_b, JobCancelRequested(job_id="a-long", requested_by="team-a-lead"),
                      JobCancelRequested.scoped_subject("team-b"))
        await wait_for(lambda: conn.fetchval("SELECT true FROM audit.records WHERE action = 'cancel_refused' AND "
                                             "job_id = 'a-long' AND actor = 'team:team-b'"),
                       what="the refusal in the audit trail")
        assert await status(conn, "a-long") == ("admitted", None)
        assert await conn.fetchval("SELECT status FROM executor.runs WHERE job_id = 'a-long'") == "running"
        # The job's own team may.
        await publish(js_a, JobCancelRequested(job_id="a-long"), JobCancelRequested.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT status = 'cancelled' FROM executor.runs WHERE job_id = 'a-long'"),
                       what="the job stopped by its own team's cancel")
        assert await status(conn, "a-long") == ("finished", "Cancelled")
    finally:
        await nc_a.close()
        await nc_b.close()


async def test_forged_placements_and_bodies_on_the_wrong_subject_are_dead_lettered(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection], admin_js: JetStreamContext) -> None:
    """Where a server lets anything through (no authentication), the executor still refuses a placement the
    scheduler did not make, and no service takes a body whose type does not belong on its subject."""
    _, conn = platform
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    eight = (GpuBinding(pod="main-0", node="h100-0", gpu_indices=tuple(range(8))),)
    try:
        # A JobPlaced body on team-b's own submission subject (the one subject it may publish on).
        smuggled = JobPlaced(job_id="smuggled", spec=job("smuggled", team="team-b"), bindings=eight, placed_at=T0,
                             fencing_token=1)
        await publish(js_b, smuggled, JobSubmitted.scoped_subject("team-b"))
        # A placement published where publishing is open (as on an unauthenticated server): never submitted.
        ghost = JobPlaced(job_id="ghost", spec=job("ghost", team="team-b"), bindings=eight, placed_at=T0,
                          fencing_token=1)
        await publish(admin_js, ghost, JobPlaced.subject())
        await publish(admin_js, ghost.model_copy(update={"job_id": "ghost-2", "fencing_token": None}),
                      JobPlaced.subject())
        # Each service consumes only its own subjects: the smuggled body is admission's to refuse (it reads the
        # submission subjects), the forged placements the executor's.
        smuggled_refused = await wait_for(lambda: _dead(conn, "admission", 1), what="a dead letter at admission")
        assert smuggled_refused == ["SubjectMismatch"]
        reasons = await wait_for(lambda: _dead(conn, "executor", 2), what="two dead letters at the executor")
        assert reasons == ["PlacementForUnknownJob", "UnfencedPlacement"]
        assert await conn.fetchval("SELECT count(*) FROM executor.runs") == 0  # nothing ran, nothing to charge
    finally:
        await nc_b.close()


async def _dead(conn: asyncpg.Connection, schema: str, at_least: int) -> list[str] | None:
    rows = await conn.fetch(f"SELECT reason FROM {schema}.dead_letters ORDER BY reason")
    return sorted(r["reason"] for r in rows) if len(rows) >= at_least else None


async def test_a_stale_placement_is_refused(auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection],
                                            admin_js: JetStreamContext) -> None:
    _, conn = platform
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    try:
        await publish(js_a, JobSubmitted(spec=job("a-real", duration_s=36_000)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT status = 'running' FROM executor.runs WHERE job_id = 'a-real'"),
                       what="the job running")
        row = await conn.fetchrow("SELECT spec, fencing_token FROM scheduler.jobs WHERE job_id = 'a-real'")
        # The same job placed elsewhere under a made-up newer term, and under the right term on other GPUs.
        spec = JobSpec.model_validate_json(row["spec"])
        elsewhere = (GpuBinding(pod="main-0", node="h100-1", gpu_indices=tuple(range(8))),)
        await publish(admin_js, JobPlaced(job_id="a-real", spec=spec, bindings=elsewhere, placed_at=T0,
                                          fencing_token=row["fencing_token"] + 5), JobPlaced.subject())
        await publish(admin_js, JobPlaced(job_id="a-real", spec=spec, bindings=elsewhere, placed_at=T0,
                                          fencing_token=row["fencing_token"]), JobPlaced.subject())
        reasons = await wait_for(lambda: _dead(conn, "executor", 2), what="two dead letters")
        assert reasons == ["ForgedFencingToken", "StalePlacement"]
        assert await conn.fetchval("SELECT nodes FROM executor.runs WHERE job_id = 'a-real'") == ["h100-0"]
    finally:
        await nc_a.close()


async def test_a_backdated_submission_does_not_jump_the_queue(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection]) -> None:
    _, conn = platform
    nc, js, _ = await auth_server.connect("producer-team-a")
    try:
        now = datetime.now(UTC)
        await publish(js, JobSubmitted(spec=job("a-running", duration_s=36_000)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT status = 'admitted' FROM admission.jobs "
                                             "WHERE job_id = 'a-running'"), what="the quota in use")
        await publish(js, JobSubmitted(spec=job("a-honest"), submitted_at=now), JobSubmitted.scoped_subject("team-a"))
        await publish(js, JobSubmitted(spec=job("a-backdated"), submitted_at=now - timedelta(days=1)),
                      JobSubmitted.scoped_subject("team-a"))
        positions = await wait_for(lambda: _positions(conn, ("a-honest", "a-backdated")), what="queue positions")
        assert positions == {"a-honest": 1, "a-backdated": 2}
    finally:
        await nc.close()


async def _positions(conn: asyncpg.Connection, jobs: tuple[str, ...]) -> dict[str, int] | None:
    rows = await conn.fetch("SELECT job_id, position_in_queue FROM admission.jobs WHERE job_id = ANY($1::text[])",
                            list(jobs))
    found = {r["job_id"]: r["position_in_queue"] for r in rows if r["position_in_queue"] is not None}
    return found if len(found) == len(jobs) else None


async def test_a_submission_naming_another_team_is_refused(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection]) -> None:
    _, conn = platform
    nc, js, _ = await auth_server.connect("producer-team-b")
    try:
        # team-b's credential, team-a's name in the payload: the team is the subject's.
        await publish(js, JobSubmitted(spec=job("posing")), JobSubmitted.scoped_subject("team-b"))
        reason = await wait_for(lambda: conn.fetchval("SELECT reason FROM admission.submissions "
                                                      "WHERE job_id = 'posing'"), what="the verdict")
        assert reason == "Unauthorized"
        # No job is recorded in team-a's name (a ghost in its view, which would also take the id from it).
        assert await conn.fetchval("SELECT status FROM admission.jobs WHERE job_id = 'posing'") is None
    finally:
        await nc.close()


# ------------------------------------------------------------------------------ the early-cancel race


async def test_a_cancel_before_the_admission_reaches_them_keeps_scheduler_and_executor_from_running_it(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection], admin_js: JetStreamContext) -> None:
    """The race of issue 14: JobCancelled seen before JobAdmitted. (Published here by hand in that order, as a
    consumer of several subjects may see them.) The scheduler never places the job and the executor never runs it."""
    _, conn = platform
    spec = job("raced")
    await publish(admin_js, JobCancelled(job_id="raced", by="team:team-a"), JobCancelled.subject())
    await publish(admin_js, JobAdmitted(job_id="raced", spec=spec, admitted_at=T0, quota={"H100-80GB": 8},
                                        flavors={"main": "H100-80GB"}), JobAdmitted.subject())
    # A later job proves both services went past the raced one.
    nc, js, _ = await auth_server.connect("producer-team-a")
    try:
        await publish(js, JobSubmitted(spec=job("after")), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT true FROM executor.runs WHERE job_id = 'after'"),
                       what="the next job started")
    finally:
        await nc.close()
    assert await conn.fetchval("SELECT status FROM scheduler.jobs WHERE job_id = 'raced'") is None
    assert await conn.fetchval("SELECT true FROM scheduler.cancelled WHERE job_id = 'raced'")
    assert await conn.fetchval("SELECT count(*) FROM executor.runs WHERE job_id = 'raced'") == 0


async def test_a_cancel_before_the_submission_leaves_a_tombstone_only_for_its_team(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection]) -> None:
    _, conn = platform
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        await publish(js_a, JobCancelRequested(job_id="early"), JobCancelRequested.scoped_subject("team-a"))
        await publish(js_b, JobCancelRequested(job_id="a-victim"), JobCancelRequested.scoped_subject("team-b"))
        await wait_for(lambda: conn.fetchval("SELECT count(*) = 2 FROM admission.tombstones"), what="tombstones")
        await publish(js_a, JobSubmitted(spec=job("early")), JobSubmitted.scoped_subject("team-a"))
        await publish(js_a, JobSubmitted(spec=job("a-victim", gpus=4)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT true FROM executor.runs WHERE job_id = 'a-victim'"),
                       what="team-a's other job running (team-b's tombstone does not apply to it)")
        assert await status(conn, "early") == ("finished", "Cancelled")
        assert await conn.fetchval("SELECT verdict FROM admission.submissions WHERE job_id = 'early'") == "cancelled"
        assert await conn.fetchval("SELECT count(*) FROM executor.runs WHERE job_id = 'early'") == 0
        assert await conn.fetchval("SELECT count(*) FROM scheduler.jobs WHERE job_id = 'early'") == 0
    finally:
        await nc_a.close()
        await nc_b.close()


# ------------------------------------------------------------------------------ governance and audit


async def test_governance_refuses_breaches_and_holds_approval_classes(
        auth_server: AuthServer, platform: tuple[Stack, asyncpg.Connection], admin_js: JetStreamContext) -> None:
    _, conn = platform
    nc, js, _ = await auth_server.connect("producer-team-a")
    try:
        subject = JobSubmitted.scoped_subject("team-a")
        await publish(js, JobSubmitted(spec=job("too-many", gpus=16)), subject)
        await publish(js, JobSubmitted(spec=job("bad-data", datasets=("customer-pii",))), subject)
        await publish(js, JobSubmitted(spec=job("huge-label").model_copy(
            update={"labels": {"sim.gpuq.io/duration-s": "60", "notes": "x" * 900_000}})), subject)
        await publish(js, JobSubmitted(spec=job("prod", priority_class="production")), subject)
        verdicts = await wait_for(lambda: _verdicts(conn, 4), what="four verdicts")
        assert verdicts["too-many"][:2] == ("rejected", "PolicyViolation")
        assert "at most 8 per job" in verdicts["too-many"][2]
        assert verdicts["bad-data"][:2] == ("rejected", "PolicyViolation")
        assert verdicts["huge-label"][:2] == ("rejected", "SpecTooLarge")
        assert verdicts["prod"][:2] == ("awaiting_approval", "AwaitingApproval")
        assert await conn.fetchval("SELECT reason FROM admission.jobs WHERE job_id = 'prod'") == "AwaitingApproval"
        await asyncio.sleep(1.0)
        assert await conn.fetchval("SELECT count(*) FROM executor.runs WHERE job_id = 'prod'") == 0
        from shared.events import JobApproved

        await publish(admin_js, JobApproved(job_id="prod", approved_by="ops"), JobApproved.subject())
        await wait_for(lambda: conn.fetchval("SELECT true FROM executor.runs WHERE job_id = 'prod'"),
                       what="the approved job running")
        # The audit service records each action from its own consumer: the scheduler's "place" may be written a
        # moment after the executor has started the job.
        expected = {("submit", "team:team-a"), ("approve", "admin:ops"), ("admit", "service:admission"),
                    ("place", "service:scheduler")}

        async def audited() -> bool:
            rows = await conn.fetch("SELECT action, actor FROM audit.records WHERE job_id = 'prod'")
            return expected <= {(r["action"], r["actor"]) for r in rows}

        await wait_for(audited, what="submit, approve, admit and place in the audit trail")
        with pytest.raises(asyncpg.RaiseError, match="append-only"):
            await conn.execute("DELETE FROM audit.records WHERE job_id = 'prod'")
    finally:
        await nc.close()


async def _verdicts(conn: asyncpg.Connection, n: int) -> dict[str, tuple[str, str | None, str]] | None:
    rows = await conn.fetch("SELECT job_id, verdict, reason, coalesce(message, '') AS message "
                            "FROM admission.submissions")
    return {r["job_id"]: (r["verdict"], r["reason"], r["message"]) for r in rows} if len(rows) >= n else None


def test_admin_is_the_only_bus_user_with_every_subject(auth_server: AuthServer) -> None:
    conf = auth_server.bundle.server_config
    users = json.loads(conf.split("\n", 1)[1])["authorization"]["users"]
    everything = [u["user"] for u in users if ">" in u["permissions"]["publish"]["allow"]]
    assert everything == [ADMIN]
    assert all(u["password"].startswith("$2a$") for u in users)  # only hashes in the server's configuration
