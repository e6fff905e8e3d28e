"""Every refusal exits non-zero with its reason, and admin mode finds the platform through the config file (issue
51): the real `gpuq`, in its own process, against real NATS, Postgres and the admission and API services."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import yaml

from services.api import tokens
from services.stack import Stack, StackSettings
from shared.config import load_cluster, load_queues
from shared.servers import free_port

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"
GPUQ = str(Path(sys.executable).parent / "gpuq")


async def gpuq(*args: str, env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(GPUQ, *args, env={**env, "COLUMNS": "200"}, cwd=cwd,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def base_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without gpuq's settings, and a config file of the test's own (none yet)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPUQ_") and k not in ("NATS_URL", "DATABASE_URL")}
    if os.environ.get("GPUQ_NAMESPACE"):
        env["GPUQ_NAMESPACE"] = os.environ["GPUQ_NAMESPACE"]
    env["GPUQ_CONFIG"] = str(tmp_path / "config.yaml")
    return env


@contextlib.asynccontextmanager
async def platform(fresh: tuple[str, str]) -> AsyncIterator[tuple[int, str]]:
    """Admission, the API, metering and preemption on the example queues; (the API's port, a token of team-a)."""
    nats_url, database_url = fresh
    port = free_port()
    settings = StackSettings(nats_url=nats_url, database_url=database_url, queues=load_queues(EXAMPLES / "queues.yaml"),
                             cluster=load_cluster(EXAMPLES / "cluster.yaml"), api_port=port, bind="127.0.0.1",
                             services=("admission", "api", "metering", "preemption"))
    async with Stack(settings):
        conn = await asyncpg.connect(database_url)
        try:
            token = (await tokens.issue(conn, "alice", team="team-a")).token
        finally:
            await conn.close()
        yield port, token


async def test_admin_submit_waits_for_the_verdict_and_cancel_of_no_job_fails(fresh: tuple[str, str],
                                                                              tmp_path: Path) -> None:
    nats_url, database_url = fresh
    env = {**base_env(tmp_path), "NATS_URL": nats_url, "DATABASE_URL": database_url}
    async with platform(fresh):
        rc, out, err = await gpuq("submit", "--team", "team-a", "--name", "fits", env=env, cwd=tmp_path)
        assert rc == 0, out + err
        assert "fits" in out and "queued" in out
        rc, out, err = await gpuq("submit", "--team", "team-a", "--gpu-model", "NO-SUCH-GPU", "--name", "nowhere",
                                  env=env, cwd=tmp_path)
        assert rc == 1, out + err
        assert "refused" in out and "nowhere" in out and "NO-SUCH-GPU" in out, out
        rc, out, err = await gpuq("cancel", "no-such-job", env=env, cwd=tmp_path)
        assert rc == 1, out + err
        assert err.strip().splitlines() == [err.strip()] and "no job 'no-such-job'" in err
        assert "cancel requested" not in out
        rc, out, err = await gpuq("approve", "no-such-job", env=env, cwd=tmp_path)
        assert rc == 1 and "no job 'no-such-job'" in err and "approved" not in out, out + err
        rc, out, err = await gpuq("approve", "fits", env=env, cwd=tmp_path)
        assert rc == 1 and "job fits is not awaiting approval" in err and "approved" not in out, out + err


async def test_through_the_api_cancel_of_no_job_fails_unless_before_arrival(fresh: tuple[str, str],
                                                                            tmp_path: Path) -> None:
    async with platform(fresh) as (port, token):
        env = {**base_env(tmp_path), "GPUQ_API_URL": f"http://127.0.0.1:{port}", "GPUQ_TOKEN": token}
        rc, out, err = await gpuq("cancel", "no-such-job", env=env, cwd=tmp_path)
        assert rc == 1, out + err
        assert "no job 'no-such-job'" in err and "--before-arrival" in err and "cancel requested" not in out
        rc, out, err = await gpuq("cancel", "not-yet-arrived", "--before-arrival", env=env, cwd=tmp_path)
        assert rc == 0, out + err
        assert "cancel requested for not-yet-arrived" in out
        rc, out, err = await gpuq("submit", "--team", "team-a", "--gpu-model", "NO-SUCH-GPU", env=env, cwd=tmp_path)
        assert rc == 1 and "refused" in out, out + err
        # the API's token and URL from the config file work as the environment's do
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"api_url": f"http://127.0.0.1:{port}",
                                                              "token": token}))
        rc, out, err = await gpuq("status", "--all", env=base_env(tmp_path), cwd=tmp_path)
        assert rc == 0, out + err


async def test_admin_mode_finds_the_platform_through_the_config_file_from_anywhere(fresh: tuple[str, str],
                                                                                   tmp_path: Path) -> None:
    nats_url, database_url = fresh
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = base_env(tmp_path)
    async with platform(fresh):
        # no URL anywhere: a clear error naming what to set
        rc, out, err = await gpuq("status", env=env, cwd=elsewhere)
        assert rc == 2 and "DATABASE_URL" in err and "config.yaml" in err, out + err
        # the URLs in the config file
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"nats_url": nats_url, "database_url": database_url}))
        rc, out, err = await gpuq("submit", "--team", "team-a", "--name", "from-config", env=env, cwd=elsewhere)
        assert rc == 0 and "queued" in out, out + err
        for command in (["status", "from-config"], ["report"], ["preemptible"]):
            rc, out, err = await gpuq(*command, env=env, cwd=elsewhere)
            assert rc == 0, (command, out, err)
        # the environment wins over the file
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"database_url": "postgresql://nobody@127.0.0.1:9/x"}))
        rc, out, err = await gpuq("status", "from-config", env={**env, "DATABASE_URL": database_url}, cwd=elsewhere)
        assert rc == 0 and "from-config" in out, out + err
        # the state directory of a running `gpuq up`, as it names it in the config file
        from cli.runtime import join_userinfo, split_userinfo

        state = tmp_path / "state"
        state.mkdir()
        plain, userinfo = split_userinfo(database_url)
        nats_plain, nats_userinfo = split_userinfo(nats_url)
        (state / "servers.json").write_text(
            f'{{"nats_url": "{nats_plain}", "database_url": "{plain}", "pid": {os.getpid()}}}')
        (state / "credentials.json").write_text(
            f'{{"pid": {os.getpid()}, "nats_url": "{nats_userinfo}", "database_url": "{userinfo}"}}')
        assert join_userinfo(plain, userinfo) == database_url
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({"state_dir": str(state)}))
        for command in (["status", "from-config"], ["report"]):
            rc, out, err = await gpuq(*command, env=env, cwd=elsewhere)
            assert rc == 0, (command, out, err)
        # a malformed file is named, not ignored
        (tmp_path / "config.yaml").write_text("database-url: x\n")
        rc, out, err = await gpuq("status", env=env, cwd=elsewhere)
        assert rc == 2 and "unknown key(s) database-url" in err, out + err


async def test_up_says_where_the_api_is_and_admin_commands_find_it_from_anywhere(fresh: tuple[str, str],
                                                                                 tmp_path: Path) -> None:
    nats_url, database_url = fresh
    port = free_port()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = base_env(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        GPUQ, "up", "--services", "admission,api", "--api-port", str(port), "--health-port", "0",
        "--log-level", "WARNING", cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**env, "NATS_URL": nats_url, "DATABASE_URL": database_url, "GPUQ_HOME": str(tmp_path / "home"),
             "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    assert proc.stdout is not None
    printed: list[str] = []
    try:
        while not printed or "Ctrl-C stops it" not in printed[-1]:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=120)
            assert line, "".join(printed)
            printed.append(line.decode())
        said = "".join(printed)
        assert f"API at http://127.0.0.1:{port}" in said and "gpuq tokens create NAME --team TEAM" in said, said
        assert "STANDBY" not in said, said
        assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"state_dir": str(tmp_path / "home")}
        # from another directory, with no URL in the environment: the servers this `gpuq up` recorded
        rc, out, err = await gpuq("tokens", "create", "newcomer", "--team", "team-a", env=env, cwd=elsewhere)
        assert rc == 0 and out.strip().splitlines()[-1].startswith("gpuq_"), out + err
        rc, out, err = await gpuq("status", "--all", env=env, cwd=elsewhere)
        assert rc == 0, out + err
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=60)
