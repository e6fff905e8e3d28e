"""The pod templates of event-submitted jobs sharing GPUs (issue 47): one replica of the resource the node shares
(nvidia.com/gpu or the renamed nvidia.com/gpu.shared), the isolation said on the pods, MPS client limits from the
fraction and the GPU memory asked; a MIG pod asks one slice of its profile."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest

from services.core.kube.placement import event_pod_sets, isolation_note, set_sharing
from shared.domain import GpuBinding, GpuSharing, JobSpec, PodSet, PodTemplate, SharingMode

TS = GpuSharing(mode=SharingMode.TIME_SLICING, replicas=4, gpu_memory_mib=81559)
MPS = GpuSharing(mode=SharingMode.MPS, replicas=10, resource="nvidia.com/gpu.shared", gpu_memory_mib=81559)


def spec(**pod_set: object) -> JobSpec:
    return JobSpec(job_id="team-a::nb", team="team-a", queue="team-a", pod_sets=(
        PodSet(name="nb", count=2, template=PodTemplate(image="jupyter:1"), **pod_set),))  # type: ignore[arg-type]


def bindings(*nodes: str) -> list[GpuBinding]:
    return [GpuBinding(pod=f"nb-{i}", node=node, shared_gpu=0, share_milli=250) for i, node in enumerate(nodes)]


def template(job: JobSpec, sharing: GpuSharing) -> dict[str, Any]:
    by_node = {"n1": sharing, "n2": sharing}
    (ps,) = event_pod_sets(job, sharing=set_sharing(job, bindings("n1", "n2"), by_node))
    return ps.template


def valid_pod(tmpl: dict[str, Any]) -> None:
    """The template as a Pod, checked against Kubernetes 1.34's schema (strict: no unknown field)."""
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **tmpl["metadata"]},
                                  "spec": tmpl["spec"]}, "1.34.0", strict=True)


def test_time_sliced_pods_ask_one_replica_and_say_they_are_not_isolated() -> None:
    tmpl = template(spec(gpus_per_pod=1, gpu_fraction=0.25), TS)
    (container,) = tmpl["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert tmpl["metadata"]["labels"] == {"gpuq.io/gpu-sharing": "time-slicing"}
    assert tmpl["metadata"]["annotations"]["gpuq.io/gpu-isolation"].startswith("none")
    assert not any(e["name"].startswith("CUDA_MPS") for e in container["env"])
    assert "isolation none" in isolation_note("nb", TS, ["n2", "n1"]) and "on n1, n2" in isolation_note("nb", TS,
                                                                                                        ["n2", "n1"])


def test_mps_pods_ask_the_renamed_resource_with_thread_and_memory_limits() -> None:
    tmpl = template(spec(gpus_per_pod=1, gpu_fraction=0.25, gpu_memory_mib=20480), MPS)
    (container,) = tmpl["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu.shared": "1"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert tmpl["metadata"]["labels"] == {"gpuq.io/gpu-sharing": "mps"}
    valid_pod(tmpl)
    # memory only: no thread limit; a tiny fraction still gets 1 percent
    env = {e["name"]: e.get("value") for e in template(spec(gpu_memory_mib=1024), MPS)["spec"][
        "containers"][0]["env"]}
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    env = {e["name"]: e.get("value") for e in template(spec(gpu_fraction=0.001), MPS)["spec"][
        "containers"][0]["env"]}
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"


def test_mig_pods_ask_one_slice_and_whole_gpu_pods_are_unchanged() -> None:
    (mig,) = event_pod_sets(spec(mig_profile="3g.40gb"))
    assert mig.template["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": "1"}
    (whole,) = event_pod_sets(spec(gpus_per_pod=2))
    assert whole.template["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert whole.template["metadata"] == {"labels": {}, "annotations": {}}


def test_a_shared_pod_set_on_no_sharing_node_is_an_error() -> None:
    job = spec(gpu_fraction=0.5)
    assert set_sharing(job, bindings("n1"), {"n1": None}) == {}
    with pytest.raises(ValueError, match="pod set nb shares a GPU but was placed on no node sharing GPUs"):
        event_pod_sets(job, sharing={})
