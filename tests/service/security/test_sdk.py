"""The producer SDK (gpuq_sdk.Client, gpuq_sdk.AsyncClient) against a running platform: the API service over real
HTTP, the bus on the authenticated NATS server with a team's credential, Postgres; and the plain-script example run
as a pipeline would run it."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from gpuq_sdk import AsyncClient, Client, GpuqError, SubmissionRefused, WaitTimeout
from shared.natsauth import team_user
from tests.service.security.conftest import ApiPlatform, AuthServer, api_platform, wait_for
from tests.service.security.test_attacks import CLUSTER, QUEUES

ROOT = Path(__file__).resolve().parents[3]
DURATION = "sim.gpuq.io/duration-s"  # the simulated executor runs a job this long (the clock runs 100x)


@pytest_asyncio.fixture
async def platform(auth_server: AuthServer, make_database: Callable[[str], Awaitable[str]]
                   ) -> AsyncIterator[ApiPlatform]:
    async with api_platform(auth_server, await make_database("sdk"), QUEUES, CLUSTER,
                            ("admission", "scheduler", "executor", "audit", "api")) as running:
        yield running


def _sync_session(base: str, token: str) -> dict[str, object]:
    """A pipeline's calls with the synchronous client (run in a thread: it blocks)."""
    seen: dict[str, object] = {}
    with Client(base, token) as gpuq:
        short = gpuq.submit(gpus=2, max_runtime_s=3600, labels={DURATION: "30", "project": "sdk"})
        seen["short_verdict"] = short.verdict
        seen["short"] = gpuq.wait(short.job_id, timeout_s=60, poll_s=0.2)
        long = gpuq.submit(job_id="sdk-long", gpus=8, max_runtime_s=100_000, labels={DURATION: "36000"})
        seen["long_status"] = gpuq.status(long.job_id)
        seen["explain"] = gpuq.explain(long.job_id)
        try:
            gpuq.wait(long.job_id, timeout_s=0.3, poll_s=0.1)
        except WaitTimeout as exc:
            seen["timeout"] = exc.last["state"]
        seen["cancel_event"] = gpuq.cancel(long.job_id, reason="no longer needed")
        seen["cancelled"] = gpuq.wait(long.job_id, timeout_s=60, poll_s=0.2)
        try:
            gpuq.submit(gpus=16)
        except GpuqError as exc:
            seen["too_big"] = (exc.status_code, str(exc))
        try:
            gpuq.submit(queue="no-such-queue")
        except SubmissionRefused as exc:
            seen["refused"] = (exc.result.verdict, exc.result.reason)
        try:
            gpuq.status("nobody-has-this")
        except GpuqError as exc:
            seen["missing"] = exc.status_code
    return seen


async def test_the_sync_client_submits_waits_explains_and_cancels(platform: ApiPlatform) -> None:
    seen = await asyncio.to_thread(_sync_session, platform.base, platform.tokens["a"])
    short = seen["short"]
    assert isinstance(short, dict)
    # the token said the team; the team's only queue was its default
    assert seen["short_verdict"] == "queued"
    assert (short["state"], short["team"], short["queue"], short["gpus"]) == ("completed", "team-a", "team-a", 2)
    assert seen["long_status"]["state"] in ("admitted", "placed", "running")  # type: ignore[index]  # a dict
    assert seen["explain"] and "job sdk-long (team team-a" in seen["explain"][0]  # type: ignore[index]  # a list
    assert seen["timeout"] in ("admitted", "placed", "running")
    cancelled = seen["cancelled"]
    assert isinstance(cancelled, dict) and cancelled["state"] == "cancelled"
    assert seen["too_big"][0] == 422 and "at most 8 per job" in seen["too_big"][1]  # type: ignore[index]  # a tuple
    assert seen["missing"] == 404
    assert seen["refused"] == ("rejected", "UnknownQueue")  # admission's verdict, raised


async def test_the_async_client_over_the_bus_and_the_api(auth_server: AuthServer, platform: ApiPlatform) -> None:
    bus = auth_server.url(team_user("team-a"))
    async with AsyncClient(platform.base, platform.tokens["a"], nats_url=bus) as gpuq:
        # over the bus: JobSubmitted on team-a's subject, with the team's credential
        sent = await gpuq.submit(team="team-a", queue="team-a", gpus=1, labels={DURATION: "20"})
        assert sent.verdict == "accepted" and sent.job_id.startswith("team-a::")
        final = await gpuq.wait(sent.job_id, timeout_s=60, poll_s=0.2)
        assert (final["state"], final["team"]) == ("completed", "team-a")
        long = await gpuq.submit(job_id="bus-long", team="team-a", queue="team-a", gpus=4,
                                 max_runtime_s=100_000, labels={DURATION: "36000"})
        await wait_for(lambda: platform.conn.fetchval(
            "SELECT status = 'running' FROM executor.runs WHERE job_id = 'bus-long'"), what="bus-long running")
        await gpuq.cancel(long.job_id, "stop", team="team-a")
        assert (await gpuq.wait(long.job_id, timeout_s=60, poll_s=0.2))["state"] == "cancelled"
        # team-a's credential may not publish on team-b's subject: the server stores nothing
        with pytest.raises(GpuqError, match="did not store"):
            await gpuq.submit(team="team-b", queue="team-b", gpus=1)
        # the bus needs what the API would have filled in
        with pytest.raises(ValueError, match="queue"):
            await gpuq.submit(team="team-a", gpus=1)
    # over the API with asyncio
    async with AsyncClient(platform.base, platform.tokens["b"]) as gpuq:
        job = await gpuq.submit({"pod_sets": [{"count": 1, "gpus_per_pod": 1}], "labels": {DURATION: "10"}})
        assert job.verdict == "queued"
        assert (await gpuq.wait(job.job_id, timeout_s=60, poll_s=0.2))["state"] == "completed"
        assert (await gpuq.explain(job.job_id))[0].startswith(f"job {job.job_id} (team team-b")


async def test_the_plain_script_example_runs_a_job_to_completion(platform: ApiPlatform) -> None:
    env = {**os.environ, "GPUQ_API_URL": platform.base, "GPUQ_TOKEN": platform.tokens["a"],
           "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "examples" / "plain_script.py"), "--gpus", "2", "--label", f"{DURATION}=30",
        "--label", "project=example", "--poll", "0.2", "--timeout", "60", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text + err.decode()
    assert "submitted team-a::" in text and ": completed (Succeeded)" in text
    job_id = re.search(r"^submitted (\S+): queued$", text, re.MULTILINE)
    assert job_id, text
    assert await platform.conn.fetchval("SELECT outcome FROM admission.jobs WHERE job_id = $1",
                                        job_id.group(1)) == "Succeeded"
