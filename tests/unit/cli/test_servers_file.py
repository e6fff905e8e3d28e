"""`gpuq up` records its servers for the other commands: the URLs in `servers.json`, their credentials only in
`credentials.json` (0600) beside it; the readers put them back together (issue 43)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from cli import runtime

NATS = "nats://admin:s%40cret:pw@127.0.0.1:4222"
DATABASE = "postgresql://gpuq:db-pass@[::1]:5432/gpuq?sslmode=disable"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(runtime, "SERVERS_FILE", tmp_path / "servers.json")
    monkeypatch.setattr(runtime, "CREDENTIALS_FILE", tmp_path / "credentials.json")
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return tmp_path


def test_servers_json_holds_no_credentials_and_readers_get_them_back(home: Path) -> None:
    assert runtime.record_servers(NATS, DATABASE)
    servers = (home / "servers.json").read_text()
    assert "s%40cret" not in servers and "db-pass" not in servers and "admin" not in servers
    assert json.loads(servers) == {"nats_url": "nats://127.0.0.1:4222",
                                   "database_url": "postgresql://[::1]:5432/gpuq?sslmode=disable",
                                   "pid": os.getpid()}
    assert stat.S_IMODE((home / "credentials.json").stat().st_mode) == 0o600
    assert runtime.nats_url() == NATS and runtime.database_url() == DATABASE

    runtime.forget_servers()
    assert not (home / "servers.json").exists() and not (home / "credentials.json").exists()


def test_credentials_of_another_instance_are_not_mixed_in(home: Path) -> None:
    """A credentials file left by another process (another pid) is not applied to this servers file."""
    (home / "servers.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:4222",
                                                   "database_url": "postgresql://127.0.0.1/x", "pid": 1}))
    (home / "credentials.json").write_text(json.dumps({"pid": 2, "nats_url": "admin:old"}))
    assert runtime.nats_url() == "nats://127.0.0.1:4222"


def test_urls_without_credentials_round_trip(home: Path) -> None:
    assert runtime.split_userinfo("nats://127.0.0.1:4222") == ("nats://127.0.0.1:4222", "")
    assert runtime.record_servers("nats://127.0.0.1:4222", "postgresql://postgres@127.0.0.1:5432/test")
    assert runtime.database_url() == "postgresql://postgres@127.0.0.1:5432/test"
    assert "postgres@" not in (home / "servers.json").read_text()
