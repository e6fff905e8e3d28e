"""/healthz and /readyz answer from a running stack on real NATS and Postgres, and tell the truth: not ready while
migrations wait, before a service has started, while NATS is gone; ready as the lease holder and as a standby."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from services.stack import Stack, StackSettings
from shared.config import parse_queues
from shared.db import migration_lock_key
from shared.health import HealthServer
from shared.servers import EmbeddedNats, free_ports

QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "queues": [{"name": "team-a", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}}],
})


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def probe(client: httpx.AsyncClient, path: str) -> tuple[int, dict[str, Any]]:
    response = await client.get(path)
    return response.status_code, response.json()


async def test_readyz_waits_for_migrations_then_leader_and_standby_are_ready(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    leader = Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES,
                                 services=("admission", "scheduler")))
    # Another replica is applying admission's migrations: this one waits for the migration lock.
    blocker = await asyncpg.connect(database_url)
    await blocker.execute("SELECT pg_advisory_lock($1)", migration_lock_key("admission"))
    async with HealthServer(leader.health, host="127.0.0.1", port=0) as health, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{health.bound_port}", timeout=10) as client:
        status, body = await probe(client, "/readyz")
        assert status == 503 and body["ready"] is False  # nothing has started: not ready, and says so per service
        assert body["services"]["admission"]["phase"] == "not started"
        assert body["services"]["scheduler"]["checks"]["runtime"] == {"ok": False, "detail": "not started yet"}

        starting = asyncio.create_task(leader.start())
        try:
            async def migrating() -> bool:
                return (await probe(client, "/readyz"))[1]["services"]["admission"]["phase"] == "migrating"

            await eventually(migrating, "admission to wait for its migrations")
            status, body = await probe(client, "/readyz")
            admission = body["services"]["admission"]
            assert status == 503 and admission["ready"] is False
            assert admission["checks"]["migrations"] == {"ok": False, "detail": "not applied yet"}
            assert admission["checks"]["postgres"]["ok"] is True  # connected, but not ready: migrations pending
            assert body["services"]["scheduler"]["phase"] == "not started"
            assert (await client.get("/healthz")).status_code == 200  # starting up is alive

            await blocker.execute("SELECT pg_advisory_unlock($1)", migration_lock_key("admission"))
            await asyncio.wait_for(starting, timeout=60)
            status, body = await probe(client, "/readyz")
            assert status == 200 and body["ready"] is True, body
            for name in ("admission", "scheduler"):
                service = body["services"][name]
                assert service["phase"] == "running"
                assert {k: c["ok"] for k, c in service["checks"].items()} == {
                    "postgres": True, "nats": True, "migrations": True, "lease": True, "consumers": True}
                assert service["checks"]["lease"]["detail"].startswith("held (term ")
            status, live = await probe(client, "/healthz")
            assert status == 200 and live["live"] is True and live["services"]["scheduler"]["phase"] == "running"

            # A second replica of the scheduler stands by for the lease: that is ready (a healthy hot standby).
            standby = Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES,
                                          services=("scheduler",), instance="1"))
            standby_start = asyncio.create_task(standby.start())
            try:
                async def standing_by() -> bool:
                    return (await standby.health()).services["scheduler"].phase == "standby"

                await eventually(standing_by, "the second scheduler to stand by")
                report = await standby.health()
                assert report.ready is True
                assert report.services["scheduler"].checks["lease"].detail == "standing by (0 of 1 leases held)"

                await leader.stop()  # the leader goes: the standby takes over and runs
                await asyncio.wait_for(standby_start, timeout=30)
                report = await standby.health()
                assert report.ready and report.services["scheduler"].phase == "running"
                assert report.services["scheduler"].checks["lease"].detail.startswith("held (term ")
            finally:
                standby_start.cancel()
                await asyncio.gather(standby_start, return_exceptions=True)
                await standby.stop()
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await leader.stop()
            await blocker.close()


async def test_readyz_reports_nats_gone_and_back(fresh: tuple[str, str], tmp_path: Path) -> None:
    _, database_url = fresh
    own_nats = EmbeddedNats(tmp_path / "nats")  # a NATS of this test's own, so that it can be stopped
    nats_url = own_nats.start()
    stack = Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, services=("scheduler",)))
    try:
        await stack.start()
        assert (await stack.health()).ready
        own_nats.stop()

        async def nats_down() -> bool:
            return not (await stack.health()).services["scheduler"].checks["nats"].ok

        await eventually(nats_down, "the NATS check to fail")
        report = await stack.health()
        assert not report.ready and report.live  # not ready (no traffic), but no reason to restart the process
        assert report.services["scheduler"].checks["nats"].detail == "NATS: not connected"
        liveness = await stack.health(connections=False)  # what /healthz serves: no round trip to either server
        assert liveness.live and set(liveness.services["scheduler"].checks) == {"migrations", "lease"}

        own_nats.start()  # same port and data directory: the client reconnects

        async def ready_again() -> bool:
            return (await stack.health()).ready

        await eventually(ready_again, "readiness after NATS came back", timeout=60)
    finally:
        await stack.stop()
        own_nats.stop()


def test_gpuq_up_serves_health_and_stops_on_sigterm_even_as_a_standby(fresh_sync: tuple[str, str],
                                                                       tmp_path: Path) -> None:
    """The chart's entry point: `gpuq up --services X` with the health port; SIGTERM ends a standby promptly."""
    nats_url, database_url = fresh_sync
    queues = tmp_path / "queues.yaml"
    queues.write_text("priority_classes: [{name: normal, value: 100, preemptible: true}]\n"
                      "queues: [{name: team-a, teams: [team-a], quotas: {H100-80GB: {nominal: 8}}}]\n")
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url, "GPUQ_HOME": str(tmp_path / "home")}
    procs: list[subprocess.Popen[bytes]] = []

    def up(port: int) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "gpuq"), "up", "--services", "scheduler", "--queues", str(queues),
             "--health-port", str(port), "--health-addr", "127.0.0.1", "--log-level", "WARNING"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def wait_ready(port: int, proc: subprocess.Popen[bytes], phase: str) -> dict[str, Any]:
        for _ in range(600):
            assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 200:
                body: dict[str, Any] = response.json()
                if body["services"]["scheduler"]["phase"] == phase:
                    return body
            time.sleep(0.1)
        raise AssertionError(f"gpuq up on :{port} did not become ready ({phase})")

    try:
        first_port, second_port = free_ports(2)
        first = up(first_port)
        wait_ready(first_port, first, "running")
        second = up(second_port)
        body = wait_ready(second_port, second, "standby")
        assert body["services"]["scheduler"]["checks"]["lease"]["ok"] is True

        second.send_signal(signal.SIGTERM)  # a standby is inside start-up: it must still stop now
        assert second.wait(timeout=30) == 0
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_free_ports_are_distinct_and_each_can_be_bound() -> None:
    """Picked together, no two ports are the same (one at a time, the kernel may hand the same one out twice), and
    each is free for a listener."""
    import socket

    ports = free_ports(40)
    assert len(set(ports)) == 40
    for port in ports:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", port))
