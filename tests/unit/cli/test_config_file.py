"""The CLI's config file (cli/runtime.py): `gpuq up` adds its state directory to it without losing what the user
wrote, never overwrites a file it cannot read, and the environment wins over it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from cli import runtime


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "gpuq" / "config.yaml"
    monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
    for env in runtime.CONFIG_KEYS.values():
        monkeypatch.delenv(env, raising=False)
    return path


def test_up_keeps_the_users_settings_and_the_file_stays_private(config: Path) -> None:
    config.parent.mkdir()
    config.write_text("api_url: http://gpuq.example:8000\ntoken: gpuq_x.y\n")
    runtime.write_config({"state_dir": "/srv/gpuq/.gpuq"})
    assert yaml.safe_load(config.read_text()) == {"api_url": "http://gpuq.example:8000", "token": "gpuq_x.y",
                                                  "state_dir": "/srv/gpuq/.gpuq"}
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert runtime.setting("token") == "gpuq_x.y"


def test_a_file_it_cannot_read_is_named_and_left_alone(config: Path) -> None:
    config.parent.mkdir()
    config.write_text("databse_url: postgresql://db/gpuq\n")
    with pytest.raises(runtime.ConfigFileError, match=r"unknown key\(s\) databse_url"):
        runtime.write_config({"state_dir": "/srv/gpuq/.gpuq"})
    assert config.read_text() == "databse_url: postgresql://db/gpuq\n"
    config.write_text("database_url: [1, 2]\n")
    with pytest.raises(runtime.ConfigFileError, match="database_url must be a string"):
        runtime.read_config()


def test_the_environment_wins_over_the_file(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime.write_config({"database_url": "postgresql://file/gpuq", "nats_url": "nats://file:4222"})
    assert runtime.database_url() == "postgresql://file/gpuq"
    monkeypatch.setenv("DATABASE_URL", "postgresql://env/gpuq")
    assert runtime.database_url() == "postgresql://env/gpuq" and runtime.nats_url() == "nats://file:4222"
