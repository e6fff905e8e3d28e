"""The user's commands against real servers: submit publishes a valid JobSubmitted; bad input is named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner

from cli.main import app
from shared.events import JobSubmitted, parse_event
from shared.namespace import subject as ns_subject

runner = CliRunner()


async def _submitted(url: str) -> list[JobSubmitted]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await js.subscribe(ns_subject("job.submitted.*"), ordered_consumer=True)
    out = []
    while True:
        try:
            msg = await sub.next_msg(timeout=0.5)
        except TimeoutError:
            break
        _, payload = parse_event(msg.data)
        assert isinstance(payload, JobSubmitted)
        out.append(payload)
    await nc.close()
    return out


@pytest.fixture
def cli_env(fresh_sync: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    nats_url, database_url = fresh_sync
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("DATABASE_URL", database_url)
    return nats_url


def test_submit_from_flags_and_file(cli_env: str, tmp_path: Path) -> None:
    # (--wait 0: no admission runs here to give a verdict)
    result = runner.invoke(app, ["submit", "--wait", "0", "--team", "team-a", "--gpus", "8", "--pods", "2", "--rack",
                                 "--name", "flagjob", "--label", "feature=pretraining"])
    assert result.exit_code == 0, result.output
    spec_file = tmp_path / "jobs.yaml"
    spec_file.write_text(json.dumps({"jobs": [
        {"job_id": "filejob", "team": "team-b", "queue": "team-b", "pod_sets": [{"count": 1, "gpus_per_pod": 1}]}]}))
    result = runner.invoke(app, ["submit", "--wait", "0", str(spec_file)])
    assert result.exit_code == 0, result.output
    published = asyncio.run(_submitted(cli_env))
    by_id = {p.spec.job_id: p.spec for p in published}
    assert by_id["flagjob"].total_gpus == 16 and by_id["flagjob"].topology.required_level == "rack"
    assert by_id["flagjob"].labels == {"feature": "pretraining"}
    assert by_id["filejob"].queue == "team-b"


def test_submit_names_what_is_wrong(cli_env: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("job_id: x\nteam: t\nqueue: q\npod_sets: [{count: 0}]\n")
    result = runner.invoke(app, ["submit", str(bad)])
    assert result.exit_code != 0
    assert "pod_sets.0.count" in result.output
    assert asyncio.run(_submitted(cli_env)) == []
