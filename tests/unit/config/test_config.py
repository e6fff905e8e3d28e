"""cluster.yaml and queues.yaml: the examples load, mistakes are named precisely, warnings flag the classics."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.config import ConfigError, load_cluster, load_queues, parse_cluster, parse_queues

EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"


def test_examples_load_and_expand() -> None:
    cluster = load_cluster(EXAMPLES / "cluster.yaml")
    queues = load_queues(EXAMPLES / "queues.yaml")
    nodes = cluster.nodes()
    assert len(nodes) == 32 + 16 + 4 + 8
    assert nodes[0].name == "h100-0" and nodes[0].rack == "h100-rack0" and nodes[0].block == "h100-block0"
    # 4 nodes per rack, 4 racks per block: node 17 is in rack 4, block 1.
    assert nodes[17].rack == "h100-rack4" and nodes[17].block == "h100-block1"
    assert cluster.gpus_by_model()["H100-80GB"] == 256
    assert queues.queue_map["team-b"].weight == 2
    assert queues.warnings(cluster) == []


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_errors_name_file_path_and_problem(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLES / "queues.yaml").read_text())
    doc["queues"][1]["quotas"]["H100-80GB"]["nominal"] = -4
    doc["queues"][0]["cohort"] = "nope"
    path = write(tmp_path, "queues.yaml", yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_queues(path)
    text = str(info.value)
    assert str(path) in text
    assert "queues[1].quotas.H100-80GB.nominal" in text and "greater than or equal to 0" in text


def test_cross_references_are_checked() -> None:
    doc = yaml.safe_load((EXAMPLES / "queues.yaml").read_text())
    doc["queues"][0]["cohort"] = "nope"
    with pytest.raises(ConfigError, match=r"queues\[0\] \(team-a\): cohort 'nope' is not declared"):
        parse_queues(doc)


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "the file is empty"),
    ("- a\n- b\n", "expected a mapping"),
    ("node_groups: [\n", "not valid YAML"),
    ("node_groups: []\n", "node_groups"),
    ("node_groups: [{name: x, count: 1, gpus_per_node: 8, gpu_model: H100, cpu_milli: 1, memory_mib: 1, colour: red}]",
     "node_groups[0].colour: Extra inputs are not permitted"),
    ("node_groups: [{name: X!, count: 1, gpus_per_node: 8, gpu_model: H100, cpu_milli: 1, memory_mib: 1}]",
     "not a valid name"),
])
def test_cluster_errors(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster(write(tmp_path, "cluster.yaml", text))
    assert fragment in str(info.value)
    assert "cluster.yaml" in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_queues(tmp_path / "absent.yaml")


def test_warnings_flag_the_classic_mistakes() -> None:
    cluster = parse_cluster({"node_groups": [{"name": "h", "count": 2, "gpus_per_node": 8, "gpu_model": "H100",
                                              "cpu_milli": 1000, "memory_mib": 1000}]})
    queues = parse_queues({
        "priority_classes": [{"name": "production", "value": 1000, "preemptible": True}],
        "cohorts": [{"name": "c"}],
        "queues": [
            {"name": "a", "cohort": "c", "quotas": {"H100": {"nominal": 12, "borrowing_limit": 0}}},
            {"name": "b", "cohort": "c", "quotas": {"H100": {"nominal": 8, "lending_limit": 0}}},
        ],
    })
    warnings = "\n".join(queues.warnings(cluster))
    assert "H100 quota sums to 20 GPUs but the cluster has 16" in warnings
    assert "queue a: borrowing_limit is 0" in warnings
    assert "queue a: every other queue of cohort c lends 0" in warnings
    assert "priority class production is preemptible" in warnings


def test_topology_csv_overrides_generated_paths(tmp_path: Path) -> None:
    csv_path = write(tmp_path, "topo.csv", "ip,DSW,PSW,ASW\nh1,G1,P1,S1\nh2,G1,P1,S2\nh3,G1,P2,S3\n")
    cluster = parse_cluster({"node_groups": [{"name": "n", "count": 4, "gpus_per_node": 8, "gpu_model": "H100",
                                              "cpu_milli": 1, "memory_mib": 1}], "topology_file": str(csv_path)})
    nodes = cluster.nodes()
    assert [(n.rack, n.block) for n in nodes[:3]] == [("P1/S1", "P1"), ("P1/S2", "P1"), ("P2/S3", "P2")]
    assert nodes[3].rack == "n-rack0"  # beyond the file: the generated path stays
