"""Governance matches names by their parts: registries at host boundaries, paths at '/' after normalising them
(`..` and odd forms refused outright), and every volume source of a pod template, so that no spelling of an
image, dataset or volume gets past a team's policy."""

from __future__ import annotations

from typing import Any

import pytest

from services.core.admission.governance import POLICY_VIOLATION, policy_violation
from shared.config import TeamPolicy
from shared.domain import JobSpec, PodSet, PodTemplate


def job(image: str = "registry.example.com/team-a/train:1", volumes: tuple[dict[str, Any], ...] = (),
        datasets: tuple[str, ...] = ()) -> JobSpec:
    template = PodTemplate(image=image, volumes=volumes)
    return JobSpec(job_id="j1", team="team-a", queue="team-a", datasets=datasets,
                   pod_sets=(PodSet(count=1, gpus_per_pod=1, template=template),))


def refusal(spec: JobSpec, policy: TeamPolicy) -> str | None:
    violation = policy_violation(spec, policy)
    if violation is None:
        return None
    assert violation.reason == POLICY_VIOLATION
    return violation.message


# ------------------------------------------------------------------------------ images: host and path boundaries


@pytest.mark.parametrize("image", [
    "registry.example.com.evil.io/team-a/train:1",  # the allowed host as a prefix of another host
    "registry.example.comevil.io/team-a/train:1",
    "evil.io/registry.example.com/train:1",
    "train:1",  # Docker Hub's library/train
])
def test_a_host_prefix_matches_only_that_host(image: str) -> None:
    message = refusal(job(image), TeamPolicy(allowed_images=("registry.example.com",)))
    assert message is not None and repr(image) in message and "registry.example.com" in message


@pytest.mark.parametrize("image", [
    "registry.example.com/team-a/train:1",
    "registry.example.com:5000/team-a/train:1",  # the host on any port
    "REGISTRY.example.com/team-a/train@sha256:" + "a" * 64,  # hosts compare without case
])
def test_a_host_prefix_allows_its_hosts_images(image: str) -> None:
    assert refusal(job(image), TeamPolicy(allowed_images=("registry.example.com",))) is None


def test_a_path_prefix_matches_at_slashes_and_a_port_only_itself() -> None:
    policy = TeamPolicy(allowed_images=("registry.example.com/team-a/", "registry.example.com:5000/tools"))
    assert refusal(job("registry.example.com/team-a/train:1"), policy) is None
    assert refusal(job("registry.example.com/team-a:1"), policy) is None
    assert refusal(job("registry.example.com:5000/tools/x:1"), policy) is None
    for image in ("registry.example.com/team-ab/train:1", "registry.example.com/team-b/train:1",
                  "registry.example.com:5001/tools/x:1", "registry.example.com/tools/x:1"):
        assert refusal(job(image), policy) is not None, image


def test_docker_hub_names_are_normalised_before_matching() -> None:
    policy = TeamPolicy(allowed_images=("docker.io/library/python",))
    assert refusal(job("python:3.11"), policy) is None
    assert refusal(job("docker.io/library/python:3.11"), policy) is None
    assert refusal(job("pythonista/python:3.11"), policy) is not None


@pytest.mark.parametrize(("image", "why"), [
    ("registry.example.com/team-a/../team-b/train:1", "'..' path segment"),
    ("registry.example.com/team-a/./train:1", "'.' path segment"),
    ("registry.example.com/team-a//train:1", "empty path segment"),
    ("registry.example.com/team-a/%2e%2e/team-b/train:1", "percent-encoded"),
    ("registry.example.com/team-a/Train:1", "lower-case"),
    ("registry.example.com/team-a/train:1 ", "whitespace"),
    ("registry.example.com/team-a/train@md5:abc", "digest"),
])
def test_odd_image_names_are_refused_outright(image: str, why: str) -> None:
    for policy in (TeamPolicy(allowed_images=("registry.example.com/team-a/",)), TeamPolicy()):
        message = refusal(job(image), policy)
        assert message is not None and "not a valid image reference" in message and why in message, message


# ------------------------------------------------------------------------------ datasets: normalised paths


@pytest.mark.parametrize(("dataset", "why"), [
    ("team-a/../team-b/customers", "'..' path segment"),
    ("team-a/./x", "'.' path segment"),
    ("team-a//x", "empty path segment"),
    ("team-a/%2E%2E/team-b", "percent-encoded"),
    ("team-a/..\\team-b", "backslash"),
])
def test_dataset_paths_with_dot_segments_or_odd_forms_are_refused(dataset: str, why: str) -> None:
    message = refusal(job(datasets=(dataset,)), TeamPolicy(allowed_datasets=("team-a/*",)))
    assert message is not None and repr(dataset) in message and why in message, message


def test_dataset_paths_are_normalised_before_matching() -> None:
    policy = TeamPolicy(allowed_datasets=("team-a/*", "s3://team-a-bucket/*"))
    assert refusal(job(datasets=("team-a/imagenet/",)), policy) is None
    assert refusal(job(datasets=("S3://team-a-bucket/x",)), policy) is None
    assert refusal(job(datasets=("team-b/imagenet",)), policy) is not None
    claimed = ({"name": "data", "persistentVolumeClaim": {"claimName": "team-a/../team-b"}},)
    assert "'..' path segment" in (refusal(job(volumes=claimed), policy) or "")


# ------------------------------------------------------------------------------ volumes of the pod templates


def test_host_paths_are_refused_unless_the_policy_lists_them() -> None:
    volume = ({"name": "node", "hostPath": {"path": "/var/lib/datasets/team-b", "type": "Directory"}},)
    for policy in (TeamPolicy(), TeamPolicy(allowed_datasets=("*",))):
        message = refusal(job(volumes=volume), policy)
        assert message is not None and "hostPath" in message and "/var/lib/datasets/team-b" in message
    assert refusal(job(volumes=volume), TeamPolicy(allowed_host_paths=("/var/lib/datasets/team-b",))) is None
    escape = ({"name": "node", "hostPath": {"path": "/var/lib/datasets/team-b/../../../etc"}},)
    message = refusal(job(volumes=escape), TeamPolicy(allowed_host_paths=("/var/lib/datasets/*",)))
    assert message is not None and "'..' path segment" in message


def test_nfs_exports_are_checked_against_the_datasets() -> None:
    policy = TeamPolicy(allowed_datasets=("nfs.example.com:/exports/team-a/*",))
    allowed = ({"name": "d", "nfs": {"server": "nfs.example.com", "path": "/exports/team-a/imagenet"}},)
    assert refusal(job(volumes=allowed), policy) is None
    other = ({"name": "d", "nfs": {"server": "nfs.example.com", "path": "/exports/team-b/customers"}},)
    message = refusal(job(volumes=other), policy)
    assert message is not None and "nfs.example.com:/exports/team-b/customers" in message
    sneaky = ({"name": "d", "nfs": {"server": "nfs.example.com", "path": "/exports/team-a/../team-b"}},)
    assert "'..' path segment" in (refusal(job(volumes=sneaky), policy) or "")
    assert "server and path" in (refusal(job(volumes=({"name": "d", "nfs": {"path": "/x"}},)), policy) or "")


@pytest.mark.parametrize("source", [
    {"iscsi": {"targetPortal": "10.0.0.9:3260", "iqn": "iqn.2001-04.com.example:storage", "lun": 0}},
    {"cephfs": {"monitors": ["10.0.0.8:6789"], "path": "/team-b"}},
    {"glusterfs": {"endpoints": "glusterfs-cluster", "path": "team-b"}},
    {"csi": {"driver": "nfs.csi.k8s.io", "volumeAttributes": {"server": "nfs.example.com", "share": "/team-b"}}},
    {"rbd": {"monitors": ["10.0.0.8:6789"], "image": "team-b"}},
])
def test_other_direct_volume_sources_are_refused_while_datasets_are_restricted(source: dict[str, Any]) -> None:
    kind = next(iter(source))
    volumes = ({"name": "d", **source},)
    message = refusal(job(volumes=volumes), TeamPolicy(allowed_datasets=("team-a/*",)))
    assert message is not None and f"mounts {kind} storage directly" in message
    assert refusal(job(volumes=volumes), TeamPolicy(allowed_datasets=("team-a/*",),
                                                    allowed_volume_sources=(kind,))) is None
    assert refusal(job(volumes=volumes), TeamPolicy()) is None  # any dataset: nothing to get past


def test_self_contained_volumes_pass_and_clones_and_image_volumes_are_checked() -> None:
    policy = TeamPolicy(allowed_datasets=("team-a/*",), allowed_images=("registry.example.com/team-a",))
    plain = ({"name": "scratch", "emptyDir": {"medium": "Memory"}}, {"name": "cfg", "configMap": {"name": "c"}},
             {"name": "s", "secret": {"secretName": "s"}}, {"name": "p", "projected": {"sources": []}})
    assert refusal(job(volumes=plain), policy) is None
    clone = ({"name": "d", "ephemeral": {"volumeClaimTemplate": {"spec": {
        "dataSource": {"kind": "PersistentVolumeClaim", "name": "team-b-customers"}}}}},)
    assert "team-b-customers" in (refusal(job(volumes=clone), policy) or "")
    mounted = ({"name": "weights", "image": {"reference": "registry.example.com.evil.io/team-a/weights:1"}},)
    assert "registry.example.com.evil.io" in (refusal(job(volumes=mounted), policy) or "")
