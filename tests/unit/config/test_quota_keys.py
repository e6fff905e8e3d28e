"""Quota keys beyond GPU models in queues.yaml (shared/quota_keys.py): misspellings are refused naming the key and
the field, and these keys are never counted as GPU models in the configuration's warnings."""

from __future__ import annotations

from typing import Any

import pytest

from shared.config import ConfigError, parse_cluster, parse_queues
from shared.quota_keys import shown


def queues(quotas: dict[str, Any], cohort_quotas: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"priority_classes": [{"name": "normal", "value": 100}],
            "cohorts": [{"name": "c", "quotas": cohort_quotas or {}}],
            "queues": [{"name": "a", "cohort": "c", "quotas": quotas}]}


@pytest.mark.parametrize(("key", "words"), [
    ("cpu", "write 'cpu_milli'"),
    ("memory", "write 'memory_mib'"),
    ("pool/no pool", "a node-pool quota is `pool/<name>`"),
    ("nvidia.com/gpu", "the only keys with '/' are node pools"),
    ("pods:x", "pods takes no ':<profile>' suffix"),
])
def test_a_misspelt_quota_key_is_refused_naming_the_key_and_the_field(key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_queues(queues({"H100": {"nominal": 8}, key: {"nominal": 4}}), "queues.yaml")
    assert words in str(err.value) and "queues[0].quotas" in str(err.value)


def test_a_cohort_quota_key_is_checked_too() -> None:
    with pytest.raises(ConfigError) as err:
        parse_queues(queues({"H100": {"nominal": 8}}, {"Memory": {"nominal": 4}}), "queues.yaml")
    assert "write 'memory_mib'" in str(err.value) and "cohorts[0].quotas" in str(err.value)


def test_the_new_keys_load_and_are_no_gpu_model_in_the_warnings() -> None:
    config = parse_queues(queues({"H100": {"nominal": 16}, "cpu_milli": {"nominal": 64000},
                                  "memory_mib": {"nominal": 4096, "lending_limit": 1024}, "pods": {"nominal": 9},
                                  "pool/spot-a100": {"nominal": 8}}))
    assert set(config.queues[0].quotas) == {"H100", "cpu_milli", "memory_mib", "pods", "pool/spot-a100"}
    cluster = parse_cluster({"node_groups": [{"name": "h", "count": 2, "gpus_per_node": 8, "gpu_model": "H100",
                                              "cpu_milli": 1000, "memory_mib": 1000}]})
    assert config.warnings(cluster) == []


def test_gpuq_queues_prints_cpu_in_cores_and_memory_in_gi_and_the_rest_as_is() -> None:
    assert [shown("cpu_milli", 256000), shown("cpu_milli", 1500), shown("memory_mib", 2097152),
            shown("memory_mib", 1000), shown("pods", 200), shown("pool/spot", 8), shown("H100-80GB", 16)] == \
        ["cpu:256", "cpu:1500m", "memory:2048Gi", "memory:1000Mi", "pods:200", "pool/spot:8", "H100-80GB:16"]
