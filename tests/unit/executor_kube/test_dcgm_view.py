"""What the Kubernetes executor tells the DCGM source: its running jobs' pods by the names their controllers gave
them, and per node the GPUs each job holds; then the attribution core finds those pods in dcgm-exporter's labels."""

from __future__ import annotations

from typing import Any

from services.core.executor.attribution import JobShare, attribute
from services.core.executor.dcgm_series import parse_results
from services.core.kube.dcgm_view import RunningJob, placements
from services.core.kube.names import job_label
from shared.config import DcgmLabels
from shared.domain import GpuBinding
from tests.unit.executor.dcgm_builders import busy, gpu, node, results


def pod(namespace: str, name: str, job_id: str | None, **labels: str) -> dict[str, Any]:
    if job_id is not None:
        labels["gpuq.io/job"] = job_label(job_id)
    return {"metadata": {"namespace": namespace, "name": name, "labels": labels}}


# Pods as each kind's controller names them (one GPU node each, so every pod's GPUs are known below).
PODS = {
    "ml-a.sweep.0b1c2d3e": [pod("ml-a", "sweep-0-x7k2p", "ml-a.sweep.0b1c2d3e", **{
        "batch.kubernetes.io/job-name": "sweep", "batch.kubernetes.io/job-completion-index": "0"})],
    "ml-a.pipe.1a2b3c4d": [pod("ml-a", "pipe-trainers-0-0-q9w8e", "ml-a.pipe.1a2b3c4d", **{
        "jobset.sigs.k8s.io/jobset-name": "pipe"})],
    "ml-a.llm.aaaabbbb": [pod("ml-a", f"llm-worker-{i}", "ml-a.llm.aaaabbbb", **{
        "training.kubeflow.org/job-name": "llm"}) for i in range(2)],
    "ml-b.tune.77665544": [pod("ml-b", "tune-raycluster-x8k2z-gpu-workers-worker-4fj2k", "ml-b.tune.77665544",
                               **{"ray.io/node-type": "worker"})],
}


def running() -> list[RunningJob]:
    return [RunningJob(job_id, job_label(job_id), [GpuBinding(pod=f"main-{i}", node=f"g{k}-{i}", gpu_indices=(0, 1))
                                                   for i in range(len(pods))], job_id.split(".")[0])
            for k, (job_id, pods) in enumerate(sorted(PODS.items()))]


def test_pods_are_keyed_by_the_names_their_controllers_gave_them() -> None:
    others = [pod("ml-a", "notebook-0", None), pod("ml-a", "old-0-abcde", "ml-a.old.12345678"),  # not running
              pod("ml-b", "copycat-0", "ml-a.sweep.0b1c2d3e")]  # another namespace's pod with a running job's label
    view = placements(running(), [p for pods in PODS.values() for p in pods] + others)
    assert view.pods == {(p["metadata"]["namespace"], p["metadata"]["name"]): job_id
                         for job_id, pods in PODS.items() for p in pods}
    assert view.devices == {} and view.uuids == {}  # the device plugin, not gpuq, picks a pod's GPUs
    assert view.nodes["g0-1"] == (JobShare("ml-a.llm.aaaabbbb", 2),)


def test_dcgm_series_labelled_with_those_pods_are_attributed_exactly_in_both_label_forms() -> None:
    view = placements(running(), [p for pods in PODS.values() for p in pods])
    devices = []
    nodes = {}
    for k, (_, pods) in enumerate(sorted(PODS.items())):
        for i, p in enumerate(pods):
            name = f"g{k}-{i}"
            # Each node has 4 GPUs: the pod's two carry its labels, relabelled exported_* on every other node.
            nodes[name] = node(name, gpus=4)
            for g in range(2):
                devices.append((gpu(name, g, pod=(p["metadata"]["namespace"], p["metadata"]["name"]),
                                     exported=bool(k % 2)), busy(0.9)))
            devices += [(gpu(name, g), busy(0.0, fb=0)) for g in (2, 3)]
    out = attribute(parse_results(results(devices), DcgmLabels()), view, nodes)
    owners = {(b.node, s.gpu_index): s.job_id for b in out.batches for s in b.samples}
    for k, (job_id, pods) in enumerate(sorted(PODS.items())):
        for i in range(len(pods)):
            assert [owners[(f"g{k}-{i}", g)] for g in range(4)] == [job_id, job_id, None, None]
    assert out.approximate == 0 and out.exact == 2 * 5 and out.unattributed == 2 * 5
