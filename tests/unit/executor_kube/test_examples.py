"""The annotated examples in deploy/examples/k8s/ are taken by gpuq as documented."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from shared.config import ClusterSource, load_cluster, load_queues

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"


def test_every_workload_example_becomes_a_job_of_team_a() -> None:
    queues = load_queues(EXAMPLES / "queues.yaml")
    cluster = load_cluster(EXAMPLES / "k8s" / "cluster.yaml")
    assert cluster.source is ClusterSource.KUBERNETES
    seen = {}
    for path in sorted((EXAMPLES / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kind = kind_of(doc.get("apiVersion", ""), doc.get("kind", ""))
            if kind is None:
                continue
            assert kind.suspended(doc), f"{path.name}: examples must be created suspended"
            doc["metadata"]["uid"] = "0123456789ab"
            spec = job_spec(kind, doc, queues, cluster.kube)
            assert not isinstance(spec, Refusal), f"{path.name}: {spec}"
            assert spec.team == "team-a"
            seen[kind.kind] = spec
    assert sorted(seen) == ["Job", "JobSet", "PyTorchJob", "RayJob"]
    assert seen["PyTorchJob"].total_gpus == 16 and seen["PyTorchJob"].topology.required_level == "rack"
    assert seen["Job"].checkpoint.supported and seen["Job"].max_runtime_s == 14400
