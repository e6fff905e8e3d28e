"""cluster.yaml `source: kubernetes` and queues.yaml's namespace -> team mapping: validated at load."""

from __future__ import annotations

import pytest

from shared.config import ClusterSource, ConfigError, parse_cluster, parse_queues
from tests.unit.executor_kube.conftest import QUEUES


def test_kubernetes_source_needs_no_node_groups_and_has_defaults() -> None:
    cfg = parse_cluster({"source": "kubernetes", "kubernetes": {"gpu_flavors": {"NVIDIA-A100-SXM4-80GB": "A100-80GB"},
                                                                "pods_ready_timeout_s": 120}})
    assert cfg.source is ClusterSource.KUBERNETES and cfg.nodes() == []
    assert cfg.kube.pods_ready_timeout_s == 120 and cfg.kube.gpu_product_label == "nvidia.com/gpu.product"
    assert parse_cluster({"source": "kubernetes"}).kube.requeue_limit == 5


def test_mixing_sources_is_refused_with_the_path() -> None:
    with pytest.raises(ConfigError, match="a kubernetes cluster reads its nodes from the API"):
        parse_cluster({"source": "kubernetes", "node_groups": [
            {"name": "g", "count": 1, "gpus_per_node": 8, "gpu_model": "H100", "cpu_milli": 1, "memory_mib": 1}]})
    with pytest.raises(ConfigError, match="a static cluster needs at least one node group"):
        parse_cluster({"node_groups": []})
    with pytest.raises(ConfigError, match=r"kubernetes\.pods_ready_timeout_s"):
        parse_cluster({"source": "kubernetes", "kubernetes": {"pods_ready_timeout_s": 0}})


def test_namespace_mapping_is_checked_against_queues_and_teams() -> None:
    cfg = parse_queues(QUEUES)
    assert cfg.namespace_map["ml-b"].team == "team-b"
    bad = {**QUEUES, "namespaces": [{"name": "ml-a", "team": "team-a", "queues": ["team-b", "nope"]},
                                    {"name": "ml-a", "team": "team-a", "queues": ["team-a"]}],
           "kubernetes_priority_classes": {"x": "missing"}}
    with pytest.raises(ConfigError) as err:
        parse_queues(bad)
    text = str(err.value)
    assert "namespaces must be listed once; repeated: ml-a" in text
    assert "team 'team-a' may not use queue 'team-b'" in text
    assert "queue 'nope' is not declared" in text
    assert "kubernetes_priority_classes.x: 'missing' is not a priority class" in text
