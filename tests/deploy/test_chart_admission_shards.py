"""Admission per cohort, deployable: `services.admission.shards` renders one Deployment (and PDB) per shard, each
serving its cohorts through GPUQ_ADMISSION_COHORTS with its own selector, on the shared `admission` bus user. What
the chart renders is checked with the runtime's own code: every queue of the chart's queues.yaml is owned by exactly
one shard (services/admission/sharding.py), and each shard's consumers are what `gpuq nats-auth --admission-cohorts`
grants for the same cohorts. Shards that would leave a cohort unserved, or serve one twice, are refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.admission.sharding import Shard, parse_cohorts
from services.stack import StackSettings, build_specs
from shared.config import parse_queues
from tests.unit.contracts.test_bus_permissions import granted_durables, plan_durables

from .test_chart import CI_VALUES

Doc = dict[str, Any]

QUEUES = {
    "priority_classes": [{"name": "normal", "value": 100}],
    "cohorts": [{"name": "research"}, {"name": "vision", "parent": "research"}, {"name": "production"}],
    "queues": [{"name": "nlp", "teams": ["nlp"], "cohort": "research", "quotas": {"H100-80GB": {"nominal": 8}}},
               {"name": "cv", "teams": ["cv"], "cohort": "vision", "quotas": {"H100-80GB": {"nominal": 8}}},
               {"name": "serving", "teams": ["serving"], "cohort": "production",
                "quotas": {"H100-80GB": {"nominal": 8}}},
               {"name": "misc", "teams": ["misc"], "quotas": {"H100-80GB": {"nominal": 8}}}],
}
SHARDS = [{"name": "research", "cohorts": ["research", "-"]},
          {"name": "production", "cohorts": ["production"], "replicas": 3,
           "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}}]


def values(tmp_path: Path, shards: Sequence[dict[str, Any]], queues: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "shards.yaml"
    path.write_text(yaml.safe_dump({"config": {"queues": queues or QUEUES},
                                    "services": {"admission": {"shards": list(shards)}}}))
    return path


def admission(docs: Sequence[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs
            if d["kind"] == kind and d["metadata"]["labels"].get("app.kubernetes.io/component") == "admission"}


def env(deployment: Doc) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_one_deployment_and_pdb_per_shard_each_serving_its_cohorts(render: Any, tmp_path: Path) -> None:
    docs = render(CI_VALUES, values(tmp_path, SHARDS))
    deployments = admission(docs, "Deployment")
    assert set(deployments) == {"gpuq-admission-research", "gpuq-admission-production"}
    research, production = deployments["gpuq-admission-research"], deployments["gpuq-admission-production"]
    assert env(research)["GPUQ_ADMISSION_COHORTS"] == "research,-"
    assert env(production)["GPUQ_ADMISSION_COHORTS"] == "production"
    for name, d in deployments.items():
        shard = name.removeprefix("gpuq-admission-")
        labels = {"app.kubernetes.io/name": "gpuq", "app.kubernetes.io/instance": "gpuq",
                  "app.kubernetes.io/component": "admission", "gpuq.io/admission-shard": shard}
        # Disjoint selectors: each Deployment's pods are its own; the pods stay `admission` for everything else.
        assert d["spec"]["selector"]["matchLabels"] == labels
        assert labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        assert d["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == labels
        assert d["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["up", "--services=admission"]
        # One bus user for every shard: `gpuq nats-auth --admission-cohorts` grants it each shard's consumers.
        assert env(d)["NATS_URL"] == {"secretKeyRef": {"name": "gpuq-nats-admission", "key": "url"}}
    assert research["spec"]["replicas"] == 2  # services.admission.replicas: a leader and a standby
    assert production["spec"]["replicas"] == 3
    assert production["spec"]["template"]["spec"]["containers"][0]["resources"] == SHARDS[1]["resources"]
    pdbs = admission(docs, "PodDisruptionBudget")
    assert {n: p["spec"]["selector"]["matchLabels"]["gpuq.io/admission-shard"] for n, p in pdbs.items()} == {
        "gpuq-admission-research": "research", "gpuq-admission-production": "production"}


def test_without_shards_one_admission_serves_every_cohort(render: Any, tmp_path: Path) -> None:
    docs = render(CI_VALUES, values(tmp_path, []))
    (single,) = admission(docs, "Deployment").values()
    assert single["metadata"]["name"] == "gpuq-admission" and "GPUQ_ADMISSION_COHORTS" not in env(single)
    assert "gpuq.io/admission-shard" not in single["spec"]["selector"]["matchLabels"]


def test_the_rendered_shards_own_every_queue_once_and_are_granted_their_consumers(render: Any,
                                                                                   tmp_path: Path) -> None:
    """The runtime's sharding over the chart's queues.yaml, and the bus grants `gpuq nats-auth` writes for the same
    --admission-cohorts: each instance's durable consumers are granted to the `admission` user it connects as."""
    docs = render(CI_VALUES, values(tmp_path, SHARDS))
    config = parse_queues(QUEUES, "chart queues")
    cohorts = [env(d)["GPUQ_ADMISSION_COHORTS"] for d in admission(docs, "Deployment").values()]
    for queue in [*(q.name for q in config.queues), "undeclared"]:
        owners = [c for c in cohorts if Shard.of(c).owns_queue(config, queue)]
        assert len(owners) == 1, (queue, owners)
    assert sum(Shard.of(c).owns_unknown_queues for c in cohorts) == 1  # one instance rejects unknown queues
    granted = granted_durables("admission", tuple(Shard.of(c).consumer_suffix for c in cohorts))
    for value in cohorts:
        settings = StackSettings(nats_url="nats://x", database_url="postgresql://x", queues=config,
                                 services=("admission",), admission_cohorts=parse_cohorts(value))
        (spec,) = build_specs(settings)
        assert plan_durables(spec) <= granted, value


@pytest.mark.parametrize(("shards", "complaint"), [
    ([{"name": "a", "cohorts": ["research"]}],
     "no shard serves -, whose jobs would wait unjudged"),
    ([{"name": "a", "cohorts": ["research", "-"]}],
     "no shard serves production, whose jobs would wait unjudged"),
    ([{"name": "a", "cohorts": ["research", "-"]}, {"name": "b", "cohorts": ["production", "research"]}],
     "cohort research is in shards a and b"),
    ([{"name": "a", "cohorts": ["vision", "research", "-", "production"]}],
     "vision is neither a root cohort of config.queues nor -"),
    ([{"name": "a", "cohorts": ["research", "-"]}, {"name": "a", "cohorts": ["production"]}],
     "two shards are named a"),
])
def test_shards_that_leave_a_cohort_unserved_or_serve_it_twice_are_refused(
        helm: Any, chart: Path, tmp_path: Path, shards: list[dict[str, Any]], complaint: str) -> None:
    res = helm("template", "gpuq", str(chart), "-f", str(CI_VALUES), "-f", str(values(tmp_path, shards)))
    assert res.returncode != 0 and complaint in res.stderr, res.stderr


@pytest.mark.parametrize(("shard", "complaint"), [
    ({"name": "Research", "cohorts": ["research"]}, "/services/admission/shards/0/name"),
    ({"name": "a", "cohorts": []}, "/services/admission/shards/0/cohorts"),
    ({"name": "a", "cohorts": ["research,production"]}, "/services/admission/shards/0/cohorts/0"),
    ({"name": "a", "cohorts": ["research"], "replicas": 0}, "/services/admission/shards/0/replicas"),
    ({"name": "a", "cohort": ["research"]}, "additional properties 'cohort' not allowed"),
])
def test_the_values_schema_refuses_a_malformed_shard(helm: Any, chart: Path, tmp_path: Path, shard: dict[str, Any],
                                                     complaint: str) -> None:
    res = helm("template", "gpuq", str(chart), "-f", str(CI_VALUES), "-f", str(values(tmp_path, [shard])))
    assert res.returncode != 0 and "values don't meet the specifications of the schema" in res.stderr
    assert complaint in res.stderr, res.stderr
