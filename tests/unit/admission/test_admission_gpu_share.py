"""Quota in fractions (issue 47): a pod set sharing a GPU is charged its milli-GPUs of `<model>:gpu-share`, or the
whole GPUs its shares add up to where the queue has no such key; one asking only GPU memory its MiB of
`<model>:gpu-memory`."""

from __future__ import annotations

from services.core.admission import AdmissionState, Reason, Workload, admission_cycle
from services.core.admission.configcheck import inventory_of
from services.core.admission.governance import gpu_request_violation
from services.core.admission.resources import request_signature
from shared.domain import GpuSharing, JobSpec, NodeSpec, PodSet, SharingMode
from tests.unit.admission.admission_core_builders import A100, H100, config, queue, submit

SHARE = f"{H100}:gpu-share"
MEMORY = f"{H100}:gpu-memory"


def shared(job_id: str, queue_name: str, *, count: int = 1, fraction: float | None = 0.25,
           gmem: int | None = None) -> JobSpec:
    return JobSpec(job_id=job_id, team=queue_name, queue=queue_name, pod_sets=(
        PodSet(count=count, gpu_fraction=fraction, gpu_memory_mib=gmem, gpu_models=(H100,)),))


def test_fractions_are_charged_in_milli_gpus_of_gpu_share() -> None:
    s = AdmissionState(config(queue("a", {SHARE: 1000, H100: 0})))
    assert request_signature(shared("x", "a", count=3)) == ((750, (H100,), "gpu-share"),)
    submit(s, shared("j1", "a", count=3))  # 750 milli-GPUs
    submit(s, shared("j2", "a", count=1))  # 250: exactly the quota
    submit(s, shared("j3", "a", count=1, fraction=0.1))  # over it
    d = admission_cycle(s, 1.0)
    assert sorted(a.spec.job_id for a in d.admitted) == ["j1", "j2"]
    assert s.admitted["j1"].usage == {SHARE: 750} and s.admitted["j2"].usage == {SHARE: 250}
    assert "j3" not in s.admitted


def test_without_a_gpu_share_quota_the_shares_are_charged_as_whole_gpus_rounded_up() -> None:
    s = AdmissionState(config(queue("a", {H100: 1}, cohort=None)))
    submit(s, shared("j1", "a", count=3, fraction=0.3))  # 0.9 GPU: one whole GPU
    submit(s, shared("j2", "a", count=1, fraction=0.1))  # no whole GPU left
    d = admission_cycle(s, 1.0)
    assert [a.spec.job_id for a in d.admitted] == ["j1"]
    assert s.admitted["j1"].usage == {H100: 1}


def test_gpu_memory_only_pods_need_a_gpu_memory_quota() -> None:
    s = AdmissionState(config(queue("a", {MEMORY: 40_000, H100: 4})))
    submit(s, shared("m1", "a", count=2, fraction=None, gmem=16_000))
    d = admission_cycle(s, 1.0)
    assert s.admitted["m1"].usage == {MEMORY: 32_000} and len(d.admitted) == 1
    no_memory_quota = AdmissionState(config(queue("b", {H100: 4})))
    rejection = no_memory_quota.submit(Workload(shared("m2", "b", fraction=None, gmem=1000), 0.0))
    assert rejection is not None and rejection.reason == Reason.NO_FLAVOR
    assert "gpu-memory" in rejection.message


def test_a_job_asking_only_part_of_a_gpu_asks_for_a_gpu() -> None:
    assert gpu_request_violation(shared("x", "a")) is None
    assert gpu_request_violation(shared("y", "a", fraction=None, gmem=512)) is None


def test_the_inventory_counts_shared_gpus_and_mixed_mig_profiles() -> None:
    nodes = [NodeSpec(name="s", gpus=4, gpu_model=H100, cpu_milli=1, memory_mib=1, rack="r", block="b",
                      sharing=GpuSharing(mode=SharingMode.MPS, replicas=4, gpu_memory_mib=80_000, shared_gpus=2)),
             NodeSpec(name="m", gpus=2, gpu_model=A100, cpu_milli=1, memory_mib=1, rack="r", block="b",
                      mig_profiles={"1g.10gb": 7})]
    inv = inventory_of(nodes)
    assert inv.gpus == {A100: 2, H100: 4}
    assert inv.slices == {f"{A100}:1g.10gb": 7, SHARE: 2000, MEMORY: 160_000}
