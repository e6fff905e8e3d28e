"""`gpuq status`, `gpuq queues` and `gpuq preemptible` as a person sees them: run in a pseudo-terminal 80 columns
wide, against a running platform (admission, scheduler, preemption and the simulated executor on real NATS and
Postgres), every line fits and no job id or queue name is cut; piped, the same tables come out at their full
width, every column whole on one line."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import nats

from services.api.readmodel import fetch_status
from services.stack import Stack, StackSettings
from shared.config import parse_cluster, parse_queues
from shared.domain import JobSpec, PodSet
from shared.events import JobSubmitted, make_event
from shared.service import publish_event

GPUQ = [str(Path(sys.executable).with_name("gpuq"))]
# queue names and job ids of the lengths people give them (a 27-character id, a 24-character queue)
QUEUE_A = "foundation-models-h100"
QUEUE_B = "inference-evaluation-queue"
QUEUES = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": QUEUE_A, "teams": ["foundation-models"], "cohort": "research",
         "quotas": {"H100-80GB": {"nominal": 16}, "A100-80GB": {"nominal": 8}, "L40S-48GB": {"nominal": 4}}},
        {"name": QUEUE_B, "teams": ["evaluation"], "cohort": "research",
         "quotas": {"H100-80GB": {"nominal": 8}, "A100-80GB": {"nominal": 16}}},
    ],
})
CLUSTER = parse_cluster({"node_groups": [{"name": "h100", "count": 3, "gpus_per_node": 8, "gpu_model": "H100-80GB",
                                          "cpu_milli": 96000, "memory_mib": 1_000_000, "nodes_per_rack": 3}]},
                        "test cluster")
JOBS = [("foundation-models-7b-run-0001", "foundation-models", QUEUE_A, 8),
        ("foundation-models-7b-run-0002", "foundation-models", QUEUE_A, 8),
        ("foundation-models-70b-run-0003", "foundation-models", QUEUE_A, 64),
        ("evaluation-harness-nightly-17", "evaluation", QUEUE_B, 8)]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def _env(nats_url: str, database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "GPUQ_API_URL", "GPUQ_TOKEN")}
    return {**env, "NATS_URL": nats_url, "DATABASE_URL": database_url, "TERM": "xterm-256color"}


def in_terminal(args: list[str], env: dict[str, str], columns: int = 80) -> tuple[int, str]:
    """`gpuq ARGS` with a pseudo-terminal of `columns` columns as stdin, stdout and stderr: what a person sees."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen([*GPUQ, *args], stdin=side, stdout=side, stderr=side, env=env, close_fds=True)
    os.close(side)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the command exited and closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    code = proc.wait(timeout=60)
    return code, ANSI.sub("", b"".join(chunks).decode()).replace("\r", "")


def run_json(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([*GPUQ, *args], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def piped(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run([*GPUQ, *args], capture_output=True, text=True, env=env, timeout=60)
    return done.returncode, done.stdout


async def _submit(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        now = datetime.now(UTC)
        for job_id, team, queue, gpus in JOBS:
            spec = JobSpec(job_id=job_id, team=team, queue=queue, max_runtime_s=7200,
                           labels={"sim.gpuq.io/duration-s": "3600"},  # running while the test looks
                           pod_sets=(PodSet(count=max(1, gpus // 8), gpus_per_pod=min(gpus, 8),
                                            gpu_models=("H100-80GB",)),))
            payload = JobSubmitted(spec=spec, submitted_at=now, submitted_by="test")
            await publish_event(js, make_event(payload, source="test", time=now), JobSubmitted.scoped_subject(team))
    finally:
        await nc.close()


async def _settled(database_url: str) -> bool:
    """Every job decided by admission, and the three it admits running (the big one is rejected)."""
    rows = await fetch_status(database_url, None)
    return {r["job_id"]: r["state"] for r in rows} == {j[0]: "rejected" if j[3] > 24 else "running" for j in JOBS}


async def test_status_and_queues_fit_80_columns_and_print_full_width_when_piped(fresh: tuple[str, str]) -> None:
    nats_url, database_url = fresh
    async with Stack(StackSettings(nats_url=nats_url, database_url=database_url, queues=QUEUES, cluster=CLUSTER,
                                   services=("admission", "scheduler", "executor", "preemption"))):
        await _submit(nats_url)
        await eventually(lambda: _settled(database_url), "every job decided, three running")
        env = _env(nats_url, database_url)

        code, screen = await asyncio.to_thread(in_terminal, ["status", "--all"], env)
        assert code == 0, screen
        lines = screen.splitlines()
        assert lines and max(len(line) for line in lines) <= 80, screen
        assert "…" not in screen, screen
        for job_id, _, queue, _ in JOBS:
            # each id whole on one line with its queue: nothing cut, nothing wrapped
            assert any(job_id in line and queue in line for line in lines), (job_id, screen)
        assert lines[1].split() == ["job", "queue", "state", "GPUs"], screen  # what is left out to fit 80
        # A wider terminal keeps more columns, the reason wrapped into what the identifiers leave.
        code, screen = await asyncio.to_thread(in_terminal, ["status", "--all"], env, 110)
        assert code == 0 and max(len(line) for line in screen.splitlines()) <= 110, screen
        assert "reason" in screen.splitlines()[1] and "…" not in screen, screen
        assert any("foundation-models-70b-run-0003" in line and "rejected" in line for line in screen.splitlines())

        code, screen = await asyncio.to_thread(in_terminal, ["queues"], env)
        assert code == 0, screen
        lines = screen.splitlines()
        assert max(len(line) for line in lines) <= 80, screen
        assert "…" not in screen, screen
        for queue in (QUEUE_A, QUEUE_B):
            assert any(line.startswith(queue) for line in lines), (queue, screen)
        for entry in ("A100-80GB:8", "H100-80GB:16", "L40S-48GB:4", "A100-80GB:16", "H100-80GB:8"):
            assert re.search(rf"(^|\s){entry}(\s|$)", screen), (entry, screen)  # whole, never split across lines

        # Piped: the whole table, one line per job, every column, however wide.
        code, out = await asyncio.to_thread(piped, ["status", "--all"], env)
        assert code == 0, out
        header = out.splitlines()[1].split()
        assert header[:6] == ["job", "team", "queue", "state", "GPUs", "submitted"], out
        assert "reason" in header and "nodes" in header, out
        assert any(len(line.rstrip()) > 80 for line in out.splitlines()), out
        for job_id, team, queue, _ in JOBS:
            assert any(re.match(rf"{job_id}\s+{team}\s+{queue}\s", line) for line in out.splitlines()), out
        assert "UTC" in out and "…" not in out
        code, out = await asyncio.to_thread(piped, ["queues"], env)
        assert code == 0, out
        row = next(line for line in out.splitlines() if line.startswith(QUEUE_A))
        assert "A100-80GB:8 H100-80GB:16 L40S-48GB:4" in row, out
        assert out.splitlines()[1].split()[:3] == ["queue", "cohort", "weight"], out
        # a line after the table, whole too (not wrapped at a guessed 80 columns)
        assert any("configuration: version 1" in line and "from queues.yaml at start" in line
                   for line in out.splitlines()), out

        # gpuq preemptible: the running jobs, ids whole at 80 columns; -o json the same jobs
        exposed = json.loads(run_json(["preemptible", "-o", "json"], env))
        assert sorted(e["job_id"] for e in exposed) == sorted(j[0] for j in JOBS if j[3] <= 24), exposed
        code, screen = await asyncio.to_thread(in_terminal, ["preemptible"], env)
        assert code == 0 and max(len(line) for line in screen.splitlines()) <= 80, screen
        assert "…" not in screen, screen
        for e in exposed:
            assert re.search(rf"^{e['job_id']}\s", screen, re.M), screen
