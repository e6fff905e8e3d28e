"""A running job holding parts of shared GPUs or slices of a mixed-MIG node, as a possible victim (issue 47): its
quota usage follows admission's units (`<model>:gpu-share` milli-GPUs, else the whole GPUs its shares add up to;
`<model>:<profile>` slices) and its lost-work weight is the fraction it holds."""

from __future__ import annotations

from services.preemption.store import running_job
from shared.config import QueuesConfig, parse_queues
from shared.domain import GpuBinding, GpuSharing, JobSpec, NodeSpec, PodSet, SharingMode


def config(quotas: dict[str, int]) -> QueuesConfig:
    return parse_queues({"priority_classes": [{"name": "normal", "value": 100, "preemptible": True}],
                         "queues": [{"name": "a", "quotas": {k: {"nominal": v} for k, v in quotas.items()}}]})


NODES = {"s": NodeSpec(name="s", gpus=2, gpu_model="A100", cpu_milli=1, memory_mib=1, rack="r", block="b",
                       sharing=GpuSharing(mode=SharingMode.MPS, replicas=4)),
         "m": NodeSpec(name="m", gpus=1, gpu_model="A100", cpu_milli=1, memory_mib=1, rack="r", block="b",
                       mig_profiles={"3g.40gb": 2})}


def test_shares_and_mixed_slices_count_as_admission_charged_them() -> None:
    spec = JobSpec(job_id="j", team="a", queue="a", pod_sets=(PodSet(name="w", count=3, gpu_fraction=0.25),))
    bindings = [GpuBinding(pod=f"w-{i}", node="s", shared_gpu=i % 2, share_milli=250, sharing=SharingMode.MPS)
                for i in range(3)]
    with_share = running_job(spec, bindings, NODES, config({"A100:gpu-share": 2000, "A100": 4}), 0.0, None)
    assert with_share.usage == {"A100:gpu-share": 750} and with_share.gpus == 0.75
    without = running_job(spec, bindings, NODES, config({"A100": 4}), 0.0, None)
    assert without.usage == {"A100": 1}  # 0.75 GPU: one whole GPU, as admission charged it
    mig = JobSpec(job_id="k", team="a", queue="a", pod_sets=(PodSet(name="w", count=2, mig_profile="3g.40gb"),))
    slices = [GpuBinding(pod=f"w-{i}", node="m", mig_slice=(0, i)) for i in range(2)]
    victim = running_job(mig, slices, NODES, config({"A100:3g.40gb": 2, "A100": 4}), 0.0, None)
    assert victim.usage == {"A100:3g.40gb": 2} and round(victim.gpus, 3) == round(2 * 428 / 1000, 3)
