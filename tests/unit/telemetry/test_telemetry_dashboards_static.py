"""Dashboards are provisioned JSON: a ${datasource} variable defaulting to the fixed uid, no __inputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.core.telemetry.names import METRICS

GRAFANA = Path(__file__).resolve().parents[3] / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
DS_UID = "gpuq-prometheus"


def panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return [p for p in out if p.get("type") != "row"]


def test_three_audiences() -> None:
    titles = {json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    assert titles == {"gpuq-ml-engineers", "gpuq-platform", "gpuq-managers"}


def test_datasource_variable_and_references() -> None:
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        assert "__inputs" not in doc and "__requires" not in doc, path.name
        variables = {v["name"]: v for v in doc["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        assert ds["current"]["value"] == DS_UID
        for p in panels(doc):
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (path.name, p["title"])
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                assert t["expr"].strip()
            assert p.get("description"), f"{path.name}: panel {p['title']!r} needs a description"
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids))


def test_provisioning_points_at_the_fixed_uid() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "gpuq.yaml").read_text())
    assert [d["uid"] for d in ds["datasources"]] == [DS_UID]
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gpuq.yaml").read_text())
    assert prov["providers"][0]["type"] == "file"


PER_JOB = sorted((n for n, d in METRICS.items() if "job_id" in d.labels), key=len, reverse=True)


def test_per_job_series_are_opt_in_where_they_are_used() -> None:
    """The `gpuq_job_*` series (job-id labels) are exported only with GPUQ_METRICS_JOB_LABELS: a panel that needs
    them says so, and no alert rule depends on them (an alert must fire on the default settings)."""
    assert PER_JOB and all(n.startswith("gpuq_job_") for n in PER_JOB)
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for p in panels(doc):
            if any(re.search(rf"\b{n}\b", t["expr"]) for t in p["targets"] for n in PER_JOB):
                assert "GPUQ_METRICS_JOB_LABELS" in p["description"], (path.name, p["title"])
    rules = (GRAFANA.parent / "prometheus" / "rules" / "gpuq.rules.yml").read_text()
    used = [n for n in PER_JOB if re.search(rf"\b{n}\b", rules)]
    assert not used, f"alert rules use per-job series, which are off by default: {used}"
