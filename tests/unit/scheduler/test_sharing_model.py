"""The domain model of GPU sharing (issue 47): a pod set asking part of a GPU, a node sharing its GPUs, a node with
mixed MIG profiles, and a binding on a shared GPU. Old documents stay byte-identical (fields added since v1)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from shared.domain import (
    GpuBinding,
    GpuSharing,
    JobSpec,
    MigLayout,
    NodeSpec,
    PodSet,
    SharingMode,
    binding_milli_gpus,
)


def node(**kw: object) -> NodeSpec:
    base: dict[str, object] = dict(name="n1", gpus=4, gpu_model="A100", cpu_milli=64000, memory_mib=1 << 19,
                                   rack="r1", block="b1")
    return NodeSpec.model_validate({**base, **kw})


def test_a_fraction_written_as_gpus_per_pod_is_a_shared_pod() -> None:
    ps = PodSet.model_validate({"name": "nb", "count": 2, "gpus_per_pod": 0.25})
    assert ps.gpu_fraction == 0.25 and ps.gpus_per_pod == 1 and ps.shared
    assert ps.share_milli == 250 and ps.gpus == 0
    spec = JobSpec(job_id="j", team="t", queue="t", pod_sets=(ps,))
    assert spec.total_gpus == 0 and spec.total_share_milli == 500


def test_whole_gpu_documents_are_unchanged() -> None:
    assert "gpu_fraction" not in PodSet().model_dump(mode="json")
    dumped = node().model_dump(mode="json")
    assert "sharing" not in dumped and "mig_profiles" not in dumped
    b = GpuBinding(pod="main-0", node="n1", gpu_indices=(0,))
    assert b.model_dump(mode="json") == {"pod": "main-0", "node": "n1", "gpu_indices": [0], "mig_slice": None}


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"gpu_fraction": 1.0}, "gpu_fraction must be above 0 and below 1"),
    ({"gpu_fraction": 0.0}, "gpu_fraction must be above 0 and below 1"),
    ({"gpu_fraction": float("nan")}, "gpu_fraction must be above 0 and below 1"),
    ({"gpu_fraction": 0.0001}, "rounds to 0 milli-GPUs"),
    ({"gpu_fraction": 0.5, "gpus_per_pod": 2}, "gpu_fraction shares one GPU per pod: set gpus_per_pod to 1"),
    ({"gpu_memory_mib": 1000, "gpus_per_pod": 0}, "gpu_memory_mib shares one GPU per pod"),
    ({"gpu_fraction": 0.5, "mig_profile": "1g.10gb"}, "gpu_fraction and mig_profile are exclusive"),
    ({"gpu_memory_mib": 0}, "gpu_memory_mib must be at least 1 MiB"),
    ({"gpu_sharing": "mps"}, "gpu_sharing needs gpu_fraction or gpu_memory_mib"),
    ({"gpu_fraction": 0.5, "gpu_sharing": "vgpu"}, "gpu_sharing"),
])
def test_bad_shares_are_refused_naming_the_field(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        PodSet.model_validate({"name": "p", **fields})


def test_node_sharing_and_mixed_mig_are_checked() -> None:
    shared = node(sharing=GpuSharing(mode=SharingMode.MPS, replicas=4, shared_gpus=2))
    assert shared.shared_gpus == 2 and node().shared_gpus == 0
    assert node(sharing={"mode": "time-slicing", "replicas": 8}).shared_gpus == 4
    with pytest.raises(ValidationError, match="replicas"):
        GpuSharing(mode=SharingMode.MPS, replicas=1)
    with pytest.raises(ValidationError, match="shared_gpus=5 exceeds its 4 GPUs"):
        node(sharing={"mode": "mps", "replicas": 2, "shared_gpus": 5})
    with pytest.raises(ValidationError, match="sharing and mig are exclusive"):
        node(sharing={"mode": "mps", "replicas": 2}, mig=MigLayout(profile="1g.10gb", slices_per_gpu=7))
    with pytest.raises(ValidationError, match=re.escape("and mig_profiles (mixed) are exclusive")):
        node(mig_profiles={"1g.10gb": 7}, mig=MigLayout(profile="1g.10gb", slices_per_gpu=7))
    with pytest.raises(ValidationError, match="mig_profiles: bogus"):
        node(mig_profiles={"bogus": 1})


def test_a_shared_binding_holds_its_share() -> None:
    spec = JobSpec(job_id="j", team="t", queue="t", pod_sets=(PodSet(gpu_fraction=0.3),))
    b = GpuBinding(pod="main-0", node="n1", shared_gpu=1, share_milli=300, sharing=SharingMode.TIME_SLICING)
    assert binding_milli_gpus(b, spec) == 300
    with pytest.raises(ValidationError, match="shared_gpu excludes gpu_indices"):
        GpuBinding(pod="main-0", node="n1", gpu_indices=(0,), shared_gpu=1, share_milli=300)
    with pytest.raises(ValidationError, match="shared_gpu and share_milli go together"):
        GpuBinding(pod="main-0", node="n1", shared_gpu=1)


def test_the_sdk_writes_a_fraction_as_a_shared_pod_set() -> None:
    from gpuq_sdk.client import job_spec

    doc = job_spec(gpus=0.5, pods=2, team="t", queue="t", job_id="j")
    (ps,) = JobSpec.model_validate(doc).pod_sets
    assert ps.gpu_fraction == 0.5 and ps.gpus_per_pod == 1 and ps.count == 2
