"""The GPUQ_* settings (shared/settings.py): every variable the product's source names is declared there, the
documentation table is the module's, pydantic-settings reads the environment as `settings()` does, and a bad value
gives one line naming its variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared import settings as mod
from shared.settings import EnvSettings, SettingsError, settings, variables

ROOT = Path(__file__).resolve().parents[3]
# The product's source; gpuq_tools (benchmarks, chaos) starts the services with these variables too.
SOURCES = ("services", "shared", "cli", "gpuq_tools")
NAME = re.compile(r"\bGPUQ_[A-Z0-9_]+")


def names_in_source() -> dict[str, str]:
    """Each GPUQ_* name in the source -> the first file naming it."""
    found: dict[str, str] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            for name in NAME.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_source_names_is_a_declared_setting() -> None:
    undeclared = {name: where for name, where in names_in_source().items()
                  if name not in variables() and name not in mod.NOT_SETTINGS}
    assert not undeclared, (f"declare these in shared/settings.py (and regenerate docs/settings.md): {undeclared}")


def test_the_documentation_table_is_the_modules() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc == mod.document(), "docs/settings.md is stale: python -m shared.settings > docs/settings.md"


def test_every_setting_has_a_description() -> None:
    assert [name for name, f in mod.Settings.model_fields.items() if not f.description] == []


def test_pydantic_settings_reads_the_environment_as_settings_does(monkeypatch: pytest.MonkeyPatch) -> None:
    given = {"GPUQ_LEASE_TTL_S": "12", "GPUQ_ADMISSION_COHORTS": "b, a,,a", "GPUQ_WEBHOOK_PORT": "9443",
             "GPUQ_METRICS_JOB_LABELS": "yes", "GPUQ_GC_FREEZE": "0", "GPUQ_AUDIT_RETENTION_DAYS": "0",
             "GPUQ_WEBHOOK_CONFIGURATIONS": "", "GPUQ_BIND": "", "GPUQ_SECRETS_KEY_FILE": "/run/key",
             "GPUQ_NAMESPACE": "team-a"}
    for var in variables():
        monkeypatch.delenv(var, raising=False)
    for var, value in given.items():
        monkeypatch.setenv(var, value)
    ours = settings()
    assert ours.model_dump() == EnvSettings().model_dump()
    assert (ours.lease_ttl_s, ours.admission_cohorts, ours.webhook_port, ours.metrics_job_labels) == (
        12.0, ("a", "b"), 9443, True)
    assert ours.bind == "127.0.0.1"  # empty is unset: the default
    assert ours.webhook_configurations == ()  # but here empty says none (the chart, with cert-manager)
    assert settings(given).model_dump() == ours.model_dump()


def test_a_value_set_after_a_read_is_seen_by_the_next_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUQ_HEARTBEAT_INTERVAL_S", "3")
    assert settings().heartbeat_interval_s == 3.0
    monkeypatch.setenv("GPUQ_HEARTBEAT_INTERVAL_S", "4.5")
    assert settings().heartbeat_interval_s == 4.5


@pytest.mark.parametrize(("var", "value", "words"), [
    ("GPUQ_LEASE_TTL_S", "3", "GPUQ_LEASE_TTL_S must be at least 5 s"),
    ("GPUQ_LEASE_TTL_S", "soon", "GPUQ_LEASE_TTL_S must be a number of seconds, not 'soon'"),
    ("GPUQ_HEARTBEAT_INTERVAL_S", "0", "GPUQ_HEARTBEAT_INTERVAL_S must be positive"),
    ("GPUQ_HEALTH_PORT", "70000", "GPUQ_HEALTH_PORT='70000': Input should be less than or equal to 65535"),
    ("GPUQ_WEBHOOK_PORT", "https", "GPUQ_WEBHOOK_PORT must be a port number, not 'https'"),
    ("GPUQ_STREAM_REPLICAS", "7", "GPUQ_STREAM_REPLICAS='7' must be a whole number from 1 to 5"),
    ("GPUQ_API_TOKEN_REVIEW", "maybe", "GPUQ_API_TOKEN_REVIEW='maybe': use true or false"),
    ("GPUQ_AUDIT_RETENTION_DAYS", "7", "GPUQ_AUDIT_RETENTION_DAYS='7' is below its floor of 30 days"),
    ("GPUQ_NAMESPACE", "Team_A", "invalid gpuq namespace 'Team_A' (GPUQ_NAMESPACE)"),
])
def test_a_bad_value_is_one_line_naming_its_variable(var: str, value: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        settings({var: value})
    message = str(caught.value)
    assert words in message and var in message and "\n" not in message


def test_an_untyped_error_becomes_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="GPUQ_HEALTH_PORT"):
        settings({"GPUQ_HEALTH_PORT": "-1"})
