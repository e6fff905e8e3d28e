"""Issue 43, items 3 and 4, replayed on a real nats-server with the bus users' configuration and a real Postgres: job
ids across teams (squatting, ghost rows, a job's state read from a refusal) and telemetry and webhooks following
admission's facts rather than what a submission says. Every attack now fails.

The attacker holds team-b's credentials: its producer bus user, its API token, its own webhook subscriptions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import asyncpg
import httpx
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from services.stack import Stack, StackSettings
from services.telemetry.webhooks import store
from services.telemetry.webhooks.ssrf import ALLOW_ENV
from shared.clock import ScaledClock
from shared.events import (
    CloudEvent,
    JobAdmitted,
    JobCompleted,
    JobQueued,
    JobRejected,
    JobStarted,
    JobSubmitted,
    Payload,
    make_event,
    parse_event,
)
from shared.natsauth import SERVICES
from shared.service import publish_event
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform, bearer, reset_streams, wait_for
from tests.service.security.test_attacks import CLUSTER, QUEUES, T0, job
from tests.service.telemetry.telemetry_receiver import Receiver

PLATFORM = ("admission", "scheduler", "executor", "audit", "api", "telemetry")
STATE_WORDS = ("pending", "admitted", "placed", "running", "finished", "rejected", "cancelled", "completed")


@pytest.fixture
def receivers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Receiver]]:
    """Webhook receivers on loopback (which telemetry is told to allow), closed after the test."""
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.0/8")
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


@pytest_asyncio.fixture
async def api(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]],
              receivers: list[Receiver]) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("identity"), QUEUES, CLUSTER, PLATFORM) as platform:
        yield platform


async def send(js: JetStreamContext, payload: Payload, subject: str) -> CloudEvent:
    event = make_event(payload, source="test", time=T0)
    await publish_event(js, event, subject)
    return event


async def verdicts(conn: asyncpg.Connection, team: str, job_ids: Sequence[str]
                   ) -> dict[str, tuple[str, str | None, str]] | None:
    """Admission's verdicts on `team`'s submissions of these ids, once there is one for each."""
    rows = await conn.fetch("SELECT job_id, verdict, reason, coalesce(message, '') AS message "
                            "FROM admission.submissions WHERE team = $1 AND job_id = ANY($2::text[])",
                            team, list(job_ids))
    found = {r["job_id"]: (r["verdict"], r["reason"], r["message"]) for r in rows}
    return found if len(found) == len(job_ids) else None


async def subscribe(c: httpx.AsyncClient, token: str, events: list[str]) -> Receiver:
    r = Receiver([])
    resp = await c.post("/v1/webhooks", json={"url": r.url, "events": events}, headers=bearer(token))
    assert resp.status_code == 201, resp.text
    r.secret = resp.json()["secret"]
    return r


# ------------------------------------------------------------------------------ job identity


async def test_another_team_can_neither_squat_an_id_nor_leave_a_row_in_the_victims_view(
        auth_server: AuthServer, api: ApiPlatform) -> None:
    """team-b submits before team-a the ids team-a will use: one naming team-a in the body (which admission used to
    record as a rejected job of team-a's: a ghost in team-a's view that also took the id), one in team-a's reserved
    form `team-a::<name>` (which used to be team-b's for the taking). Neither leaves a row; team-a's own submissions
    of both ids are then queued."""
    conn = api.conn
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        await send(js_b, JobSubmitted(spec=job("a-train")), JobSubmitted.scoped_subject("team-b"))
        refused = await wait_for(lambda: verdicts(conn, "team-b", ("a-train",)), what="admission's verdict")
        assert refused["a-train"][:2] == ("rejected", "Unauthorized")
        assert await conn.fetchval("SELECT count(*) FROM admission.jobs") == 0  # nothing holds the id
        async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
            seen = (await c.get("/v1/jobs", params={"all": True}, headers=bearer(api.tokens["a"]))).json()
        assert seen == []  # no ghost in team-a's view

        await send(js_b, JobSubmitted(spec=job("team-a::train", team="team-b")), JobSubmitted.scoped_subject("team-b"))
        refused = await wait_for(lambda: verdicts(conn, "team-b", ("team-a::train",)), what="admission's verdict")
        assert refused["team-a::train"][:2] == ("rejected", "JobIdUnavailable")
        assert await conn.fetchval("SELECT count(*) FROM admission.jobs") == 0

        for job_id in ("a-train", "team-a::train"):
            await send(js_a, JobSubmitted(spec=job(job_id, gpus=4)), JobSubmitted.scoped_subject("team-a"))
        queued = await wait_for(lambda: verdicts(conn, "team-a", ("a-train", "team-a::train")),
                                what="admission's verdicts on team-a's submissions")
        assert {j: v[0] for j, v in queued.items()} == {"a-train": "queued", "team-a::train": "queued"}
        rows = await conn.fetch("SELECT job_id, team FROM admission.jobs ORDER BY job_id")
        assert [(r["job_id"], r["team"]) for r in rows] == [("a-train", "team-a"), ("team-a::train", "team-a")]
    finally:
        await nc_a.close()
        await nc_b.close()


async def test_the_api_assigns_an_id_no_other_team_can_take(api: ApiPlatform) -> None:
    """A submission without a job_id is given one, qualified with the team (reserved for it) and random."""
    async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
        body = job("placeholder", gpus=2).model_dump(mode="json", exclude={"job_id"})
        first = await c.post("/v1/jobs", json=body, headers=bearer(api.tokens["a"]))
        second = await c.post("/v1/jobs", json=body, headers=bearer(api.tokens["a"]))
        assert first.status_code == second.status_code == 202, first.text
        ids = [first.json()[0]["job_id"], second.json()[0]["job_id"]]
        assert ids[0] != ids[1] and all(i.startswith("team-a::") and len(i) == len("team-a::") + 20 for i in ids)
        assert [r.json()[0]["verdict"] for r in (first, second)] == ["queued", "queued"]
        taken = await c.post("/v1/jobs", json={**body, "job_id": ids[0], "team": "team-b", "queue": "team-b"},
                             headers=bearer(api.tokens["b"]))
        assert taken.status_code == 409 and "JobIdUnavailable" in taken.json()["detail"]


async def test_a_refusal_of_another_teams_job_id_says_nothing_of_that_job(
        auth_server: AuthServer, api: ApiPlatform) -> None:
    """team-b used to read team-a's job's state from the 409 of a submission of its id ("already submitted
    (admitted)"), from admission's verdict on the bus, and whether the id was held from a cancel (404, where an
    unknown id gets 202), the refused cancel's audit record naming team-a. Now: one answer for another team's job
    whatever its state and for an id reserved for another team that no job has; a cancel answered as for an unknown
    id (and refused by admission: the job runs on)."""
    conn, tok = api.conn, api.tokens
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
            r = await c.post("/v1/jobs", json=job("a-secret", duration_s=36_000).model_dump(mode="json"),
                             headers=bearer(tok["a"]))
            assert r.status_code == 202 and r.json()[0]["verdict"] == "queued", r.text
            await wait_for(lambda: conn.fetchval("SELECT status = 'running' FROM executor.runs "
                                                 "WHERE job_id = 'a-secret'"), what="team-a's job running")

            async def refusal(job_id: str) -> str:
                resp = await c.post("/v1/jobs", json=job(job_id, team="team-b").model_dump(mode="json"),
                                    headers=bearer(tok["b"]))
                assert resp.status_code == 409, resp.text
                return str(resp.json()["detail"]).replace(job_id, "<id>")

            while_running = await refusal("a-secret")
            assert not [w for w in STATE_WORDS if w in while_running] and "team-a" not in while_running
            assert while_running == await refusal("team-a::never-submitted")  # as for a mere reservation

            # The bus: admission's verdict, which the API shows its submitter, in the same words.
            await send(js_b, JobSubmitted(spec=job("a-secret", team="team-b")), JobSubmitted.scoped_subject("team-b"))
            verdict = await wait_for(lambda: verdicts(conn, "team-b", ("a-secret",)), what="admission's verdict")
            assert verdict["a-secret"][1] == "JobIdUnavailable"
            assert f"JobIdUnavailable: {verdict['a-secret'][2]}".replace("a-secret", "<id>") == while_running

            cancels = [await c.post(f"/v1/jobs/{j}/cancel", headers=bearer(tok["b"]))
                       for j in ("a-secret", "never-submitted")]
            assert [x.status_code for x in cancels] == [202, 202]
            assert [sorted(x.json()) for x in cancels] == [["event_id", "job_id", "status"]] * 2
            assert cancels[0].json()["status"] == cancels[1].json()["status"]
            await wait_for(lambda: conn.fetchval("SELECT true FROM audit.records WHERE action = 'cancel_refused' "
                                                 "AND job_id = 'a-secret'"), what="admission's refusal of the cancel")
            assert await conn.fetchval("SELECT status FROM executor.runs WHERE job_id = 'a-secret'") == "running"
            records = (await c.get("/v1/audit", params={"job_id": "a-secret"}, headers=bearer(tok["b"]))).json()
            assert {r["action"] for r in records} >= {"cancel_refused", "submit_refused"}
            assert "team-a" not in json.dumps(records)  # team-b's records do not name the job's team

            # The same answer once the job has ended.
            assert (await c.post("/v1/jobs/a-secret/cancel", headers=bearer(tok["a"]))).status_code == 202
            await wait_for(lambda: conn.fetchval("SELECT status = 'finished' FROM admission.jobs "
                                                 "WHERE job_id = 'a-secret'"), what="team-a's cancel")
            assert await refusal("a-secret") == while_running
    finally:
        await nc_b.close()


# ------------------------------------------------------------------------------ telemetry follows admission's facts


async def test_resubmitting_another_teams_job_id_leaves_its_telemetry_as_it_was(
        auth_server: AuthServer, api: ApiPlatform) -> None:
    """team-b resubmits team-a's running job's id. Telemetry used to take the resubmission's team over the job's,
    then drop the job's record on admission's refusal: gone from the gauges and the table a restart rebuilds them
    from."""
    conn = api.conn
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        await send(js_a, JobSubmitted(spec=job("a-long", duration_s=36_000)), JobSubmitted.scoped_subject("team-a"))
        await wait_for(lambda: conn.fetchval("SELECT doc->>'phase' = 'running' FROM telemetry.jobs "
                                             "WHERE job_id = 'a-long'"), what="telemetry seeing team-a's job run")
        await send(js_b, JobSubmitted(spec=job("a-long", team="team-b")),
                   JobSubmitted.scoped_subject("team-b"))
        await wait_for(lambda: verdicts(conn, "team-b", ("a-long",)), what="admission's refusal")
        # Telemetry has handled admission's refusal (its inbox holds the event): committed state, no callback.
        refusal = await wait_for(lambda: conn.fetchval(
            "SELECT event_id FROM admission.outbox WHERE subject LIKE '%job.rejected%' "
            "AND convert_from(body, 'UTF8') LIKE '%a-long%'"), what="the refusal's event")
        await wait_for(lambda: conn.fetchval("SELECT true FROM telemetry.inbox WHERE event_id = $1", refusal),
                       what="telemetry handling the refusal")
        doc = json.loads(await conn.fetchval("SELECT doc FROM telemetry.jobs WHERE job_id = 'a-long'") or "null")
        assert doc is not None, "the job's record was erased"
        assert (doc.get("team"), doc.get("queue"), doc.get("phase")) == ("team-a", "team-a", "running")
    finally:
        await nc_a.close()
        await nc_b.close()


async def test_a_forged_submission_is_never_signed_for_the_team_it_names(
        auth_server: AuthServer, api: ApiPlatform, receivers: list[Receiver]) -> None:
    """team-b publishes, with its own credential, a submission whose body names team-a. Telemetry used to route its
    `job.submitted` by the body: team-a's receiver got it, signed with team-a's secret. It goes to the publisher's
    team only."""
    conn = api.conn
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        async with httpx.AsyncClient(base_url=api.base, timeout=30) as c:
            to_a = await subscribe(c, api.tokens["a"], ["job.submitted"])
            to_b = await subscribe(c, api.tokens["b"], ["job.submitted"])
        receivers += [to_a, to_b]
        forged = await send(js_b, JobSubmitted(spec=job("forged-for-a")), JobSubmitted.scoped_subject("team-b"))
        real = await send(js_a, JobSubmitted(spec=job("a-real", gpus=2)), JobSubmitted.scoped_subject("team-a"))
        # Telemetry handles the stream in order: once team-a's real submission is queued for delivery, the forged one
        # (published before it) has been handled too.
        await wait_for(lambda: conn.fetchval("SELECT true FROM telemetry.webhook_deliveries WHERE event_id = $1",
                                             real.id), what="the real submission's delivery")
        subs = {s.team: s.id for s in await store.list_subscriptions(conn)}
        forged_to = await conn.fetch("SELECT subscription_id FROM telemetry.webhook_deliveries WHERE event_id = $1",
                                     forged.id)
        assert [r["subscription_id"] for r in forged_to] == [subs["team-b"]]  # its publisher's own, never team-a's
        await wait_for(lambda: _got(to_a, real.id), what="team-a's receiver getting its own submission")
        assert all(parse_event(body)[0].id != forged.id for _, body, _ in to_a.requests)
    finally:
        await nc_a.close()
        await nc_b.close()


async def _got(r: Receiver, event_id: str) -> bool:
    return any(ok and parse_event(body)[0].id == event_id for _, body, ok in r.requests)


@pytest_asyncio.fixture
async def telemetry_only(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]],
                         receivers: list[Receiver]) -> AsyncIterator[asyncpg.Connection]:
    """Telemetry alone on its own bus user; the platform's facts are published by hand (the admin credential standing
    for their owners), in an order the real services may produce."""
    await reset_streams(auth_server.admin_url)
    database_url = await make_database("identity_telemetry")
    settings = StackSettings(nats_url=auth_server.admin_url, database_url=database_url, queues=QUEUES,
                             cluster=CLUSTER, services=("telemetry",), clock=ScaledClock(1.0),
                             nats_urls={s: auth_server.url(s) for s in SERVICES})
    async with Stack(settings):
        conn = await asyncpg.connect(database_url)
        try:
            yield conn
        finally:
            await conn.close()


async def test_another_teams_resubmission_does_not_route_a_jobs_completion_to_it(
        auth_server: AuthServer, telemetry_only: asyncpg.Connection, admin_js: JetStreamContext,
        receivers: list[Receiver]) -> None:
    """team-b resubmits team-a's running job's id with its own team in the body, and the job ends before admission's
    refusal of the resubmission reaches telemetry (admission and the executor publish independently: nothing orders
    the refusal before the end). Telemetry used to take the resubmission's team for the job's and send the job's
    `job.completed` to team-b's webhook. It goes to team-a's."""
    conn = telemetry_only
    to_a, to_b = Receiver([]), Receiver([])
    receivers += [to_a, to_b]
    for r, team in ((to_a, "team-a"), (to_b, "team-b")):
        r.secret = (await store.add_subscription(conn, r.url, team, ["job.completed"])).secret
    nc_a, js_a, _ = await auth_server.connect("producer-team-a")
    nc_b, js_b, _ = await auth_server.connect("producer-team-b")
    try:
        spec = job("a-run")
        await send(js_a, JobSubmitted(spec=spec), JobSubmitted.scoped_subject("team-a"))
        await send(admin_js, JobQueued(job_id="a-run", queue="team-a", team="team-a"), JobQueued.subject())
        await send(admin_js, JobAdmitted(job_id="a-run", spec=spec, admitted_at=T0, flavors={"main": "H100-80GB"}),
                   JobAdmitted.subject())
        await send(admin_js, JobStarted(job_id="a-run", started_at=T0), JobStarted.subject())
        await send(js_b, JobSubmitted(spec=job("a-run", team="team-b")),
                   JobSubmitted.scoped_subject("team-b"))
        done = await send(admin_js, JobCompleted(job_id="a-run", finished_at=T0), JobCompleted.subject())
        late = await send(admin_js, JobRejected(job_id="a-run", team="team-b", queue="team-b",
                                                reason="JobIdUnavailable", message="not available to team team-b"),
                          JobRejected.subject())
        await wait_for(lambda: conn.fetchval("SELECT true FROM telemetry.inbox WHERE event_id = $1", late.id),
                       what="telemetry handling the late refusal")
        subs = {s.team: s.id for s in await store.list_subscriptions(conn)}
        went_to = await conn.fetch("SELECT subscription_id FROM telemetry.webhook_deliveries WHERE event_id = $1",
                                   done.id)
        assert [r["subscription_id"] for r in went_to] == [subs["team-a"]]
        await wait_for(lambda: _got(to_a, done.id), what="team-a's receiver getting its job's completion")
        assert not to_b.requests
    finally:
        await nc_a.close()
        await nc_b.close()
