"""Dashboards are provisioned JSON: a ${datasource} variable defaulting to the fixed uid, no __inputs."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

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
