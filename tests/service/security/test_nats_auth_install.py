"""`gpuq nats-auth` as a platform team uses it to install with authentication on: the server's configuration and
each service's credentials, the Kubernetes Secrets the Helm chart reads, rotation of one user, and the server's
part loaded the way docs/install.md tells (included from a directory beside the server's own configuration, as the
NATS chart mounts it), on a real nats-server: each service's URL from its Secret connects with exactly its
permissions."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from shared.natsauth import ADMIN, KUBE, SERVICES, inbox_prefix_for, url_user
from shared.servers import free_port, port_in_use
from tests.service.security.conftest import _binaries

QUEUES = {"priority_classes": [{"name": "normal", "value": 100}],
          "queues": [{"name": "vision", "teams": ["vision"], "quotas": {"H100-80GB": {"nominal": 8}}},
                     {"name": "nlp", "teams": ["nlp"], "quotas": {"H100-80GB": {"nominal": 8}}}]}


def nats_auth(tmp_path: Path, *args: str) -> Any:
    queues = tmp_path / "queues.yaml"
    queues.write_text(yaml.safe_dump(QUEUES))
    res = CliRunner().invoke(app, ["nats-auth", "--queues", str(queues), "--out", str(tmp_path / "auth"),
                                   "--bcrypt-cost", "4", *args])
    return res


def secrets_of(path: Path) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text())}


def test_nats_auth_writes_the_server_config_credentials_and_the_charts_secrets(tmp_path: Path) -> None:
    res = nats_auth(tmp_path, "--url", "nats://nats.messaging.svc:4222", "--namespace", "prod",
                    "--kube-secrets", str(tmp_path / "secrets.yaml"), "--kube-namespace", "gpuq-system")
    assert res.exit_code == 0, res.output
    auth = tmp_path / "auth"
    for path in (auth / "nats-auth.conf", auth / "credentials.json", tmp_path / "secrets.yaml"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path  # credentials, readable by their owner only
    creds = json.loads((auth / "credentials.json").read_text())
    assert creds["namespace"] == "prod"
    assert set(creds["users"]) == {*SERVICES, KUBE, ADMIN, "producer-nlp", "producer-vision"}
    server_conf = (auth / "nats-auth.conf").read_text()
    for user, entry in creds["users"].items():
        assert entry["password"] not in server_conf  # the server holds bcrypt hashes only
        assert url_user(entry["url"]) == user and "@nats.messaging.svc:4222" in entry["url"]
    assert '"prod.job.placed"' in server_conf and '"gpuq.job.placed"' not in server_conf  # the platform's namespace

    secrets = secrets_of(tmp_path / "secrets.yaml")
    # One per service user, the Kubernetes intake's, and the server's part; none for people or pipelines.
    assert set(secrets) == {*(f"gpuq-nats-{u}" for u in (*SERVICES, KUBE)), "gpuq-nats-server-auth"}
    for name, secret in secrets.items():
        assert secret["kind"] == "Secret" and secret["metadata"]["namespace"] == "gpuq-system"
        if name == "gpuq-nats-server-auth":
            assert secret["stringData"] == {"nats-auth.conf": server_conf}
        else:
            assert secret["stringData"] == {"url": creds["users"][name.removeprefix("gpuq-nats-")]["url"]}

    # Rotation: one user gets a new password, the others keep theirs (their processes need no restart).
    res = nats_auth(tmp_path, "--url", "nats://nats.messaging.svc:4222", "--namespace", "prod", "--rotate", "scheduler")
    assert res.exit_code == 0 and "new passwords for scheduler" in res.output, res.output
    rotated = json.loads((auth / "credentials.json").read_text())["users"]
    assert {u for u in rotated if rotated[u]["password"] != creds["users"][u]["password"]} == {"scheduler"}


def test_nats_auth_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    res = nats_auth(tmp_path, "--kube-secrets", str(tmp_path / "s.yaml"))
    assert res.exit_code == 2 and "--kube-secrets needs --url" in res.output
    res = nats_auth(tmp_path, "--rotate", "scheduler")
    assert res.exit_code == 2 and "--rotate needs the existing" in res.output  # would change every password
    res = nats_auth(tmp_path, "--namespace", "Prod_1")
    assert res.exit_code == 2 and "invalid gpuq namespace" in res.output


@pytest.fixture(params=_binaries(), ids=lambda b: "nats-" + Path(b).parent.name)
def chart_layout_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A nats-server whose own configuration includes the generated users from a sibling directory, as the NATS
    chart runs it with docs/install.md's values (config at /etc/nats-config/nats.conf, the Secret mounted at
    /etc/gpuq-nats-auth/)."""
    port = free_port()
    res = nats_auth(tmp_path, "--url", f"nats://127.0.0.1:{port}", "--namespace", "prod",
                    "--kube-secrets", str(tmp_path / "secrets.yaml"))
    assert res.exit_code == 0, res.output
    server_secret = secrets_of(tmp_path / "secrets.yaml")["gpuq-nats-server-auth"]
    mounted = tmp_path / "etc" / "gpuq-nats-auth"
    mounted.mkdir(parents=True)
    (mounted / "nats-auth.conf").write_text(server_secret["stringData"]["nats-auth.conf"])
    config_dir = tmp_path / "etc" / "nats-config"
    config_dir.mkdir()
    (config_dir / "nats.conf").write_text(
        "{\n  include ../gpuq-nats-auth/nats-auth.conf;\n"
        f'  "port": {port},\n  "jetstream": {{"store_dir": "{tmp_path / "js"}"}}\n}}\n')
    proc = subprocess.Popen([request.param, "-c", str(config_dir / "nats.conf"), "-a", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not port_in_use(port):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "nats-server exited"
            assert time.monotonic() < deadline, "nats-server did not listen"
            time.sleep(0.05)
        yield tmp_path / "secrets.yaml"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_each_services_secret_connects_with_its_own_permissions_on_a_server_including_them(
        chart_layout_server: Path) -> None:
    secrets = secrets_of(chart_layout_server)
    scheduler_url = secrets["gpuq-nats-scheduler"]["stringData"]["url"]
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await nats.connect(scheduler_url, error_cb=on_error, inbox_prefix=inbox_prefix_for(scheduler_url),
                            max_reconnect_attempts=0)
    try:
        await nc.publish("prod.job.placed", b"{}")  # its own fact
        await nc.publish("prod.job.completed", b"{}")  # the executor's: refused by the server
        await nc.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.1)
        assert [str(e) for e in errors if "ermissions" in str(e)], errors
        assert all("prod.job.placed" not in str(e).lower() for e in errors)
        assert any("prod.job.completed" in str(e).lower() for e in errors)
    finally:
        await nc.close()
    # A wrong password is not let in.
    wrong = scheduler_url.replace("scheduler:", "scheduler:x", 1)
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(wrong, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
