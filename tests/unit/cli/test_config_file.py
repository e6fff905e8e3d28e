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


def test_a_write_replaces_the_file_whole(config: Path) -> None:
    # Several `gpuq up` started together each write the file: written in place (truncate, then write), two writers
    # interleaved into a file no command could read. Written beside it and renamed over it, a reader (or a second
    # writer) sees one whole version or the other: the old file stays whole under whoever still reads it.
    config.parent.mkdir()
    config.write_text("api_url: http://gpuq.example:8000\n")
    with config.open() as held:
        runtime.write_config({"state_dir": "/srv/gpuq/.gpuq"})
        assert held.read() == "api_url: http://gpuq.example:8000\n"  # the version it opened, intact
    assert yaml.safe_load(config.read_text())["state_dir"] == "/srv/gpuq/.gpuq"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert [p.name for p in config.parent.iterdir()] == ["config.yaml"]  # no temporary file left beside it


def test_a_symlinked_config_keeps_its_link_and_a_device_is_written_in_place(config: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "dotfiles" / "gpuq.yaml"
    target.parent.mkdir()
    target.write_text("api_url: http://gpuq.example:8000\n")
    config.parent.mkdir()
    config.symlink_to(target)
    runtime.write_config({"state_dir": "/srv/gpuq/.gpuq"})
    assert config.is_symlink() and yaml.safe_load(target.read_text())["state_dir"] == "/srv/gpuq/.gpuq"
    # GPUQ_CONFIG=/dev/null, as the test harnesses and `gpuq bench` point it: written in place, never renamed over
    # (a file made beside it first would mean /dev/null replaced by a file: refuse to make one at all)
    import tempfile

    def no_temporary_file(*args: object, **kwargs: object) -> None:
        raise AssertionError("a device must not be replaced by a file")

    monkeypatch.setattr(tempfile, "mkstemp", no_temporary_file)
    monkeypatch.setenv(runtime.CONFIG_ENV, "/dev/null")
    mode = Path("/dev/null").stat().st_mode
    runtime.write_config({"state_dir": "/srv/gpuq/.gpuq"})
    # still the device, its mode untouched (writing the config made it 0600 before: a root `gpuq up` with this
    # setting took /dev/null from every other user)
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode) and Path("/dev/null").stat().st_mode == mode
