"""Intake: suspended workloads -> JobSpec; the team from the namespace; refusals with reasons."""

from __future__ import annotations

from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig
from shared.domain import TopologyLevel
from tests.unit.executor_kube.conftest import job, pod_template, pytorchjob

JOB = kind_of("batch/v1", "Job")
PYTORCH = kind_of("kubeflow.org/v1", "PyTorchJob")


def test_indexed_job_becomes_a_jobspec_of_its_namespace_team(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    obj = job(activeDeadlineSeconds=7200, labels={"gpuq.io/priority-class": "low", "team": "team-b"},
              annotations={"gpuq.io/checkpoint": "true", "gpuq.io/checkpoint-interval-s": "900"})
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert spec.job_id == "ml-a.sweep.0b1c2d3e"
    assert (spec.team, spec.queue, spec.priority_class) == ("team-a", "team-a", "low")  # never the "team" label
    assert spec.max_runtime_s == 7200 and spec.checkpoint.supported and spec.checkpoint.interval_s == 900
    (ps,) = spec.pod_sets
    assert (ps.count, ps.gpus_per_pod, ps.cpu_milli, ps.memory_mib) == (2, 8, 16000, 65536)
    assert spec.workload is not None and spec.workload.key == "Job/ml-a/sweep"
    assert spec.workload.uid == "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"


def test_priority_from_priority_class_name_and_limit_from_annotation(queues: QueuesConfig,
                                                                     kube_cfg: KubernetesSource) -> None:
    obj = job(annotations={"gpuq.io/max-runtime-s": "600"})
    obj["spec"]["template"] = pod_template(priorityClassName="research-high")
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert spec.priority_class == "high" and spec.max_runtime_s == 600 and not spec.checkpoint.supported


def test_pytorchjob_workers_and_topology(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    spec = job_spec(PYTORCH, pytorchjob(workers=2, gpus=8), queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("worker", 2, 8)]
    assert spec.topology.required_level is TopologyLevel.RACK and spec.total_gpus == 16


def test_unmapped_namespace_and_foreign_queue_are_refused(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    refused = job_spec(JOB, job(namespace="scratch"), queues, kube_cfg)
    assert isinstance(refused, Refusal) and refused.reason == "UnmappedNamespace"
    assert "namespace scratch is not mapped" in refused.message
    foreign = job_spec(JOB, job(labels={"gpuq.io/queue": "team-b"}), queues, kube_cfg)
    assert isinstance(foreign, Refusal) and foreign.reason == "QueueNotAllowed"


def test_bad_annotations_are_refused_with_the_reason(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    bad = job_spec(JOB, job(annotations={"gpuq.io/min-members": "many"}), queues, kube_cfg)
    assert isinstance(bad, Refusal) and bad.reason == "InvalidWorkload" and "gpuq.io/min-members" in bad.message
    unknown = job_spec(JOB, job(labels={"gpuq.io/priority-class": "urgent"}), queues, kube_cfg)
    assert isinstance(unknown, Refusal) and unknown.reason == "UnknownPriorityClass"


def test_retry_annotations_become_the_jobs_retry_policy(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    spec = job_spec(JOB, job(annotations={"gpuq.io/retry-backoff-limit": "3", "gpuq.io/retry-backoff-s": "30",
                                          "gpuq.io/retry-reasons": "NodeFailure, ImagePullFailed"}), queues, kube_cfg)
    assert not isinstance(spec, Refusal) and spec.retry is not None
    assert (spec.retry.backoff_limit, spec.retry.backoff_s) == (3, 30.0)
    assert spec.retry.reasons == ("ImagePullFailed", "NodeFailure")
    plain = job_spec(JOB, job(), queues, kube_cfg)
    assert not isinstance(plain, Refusal) and plain.retry is None
    for given, says in (({"gpuq.io/retry-backoff-limit": "3", "gpuq.io/retry-reasons": "Cancelled"}, "Cancelled"),
                              ({"gpuq.io/retry-backoff-s": "5"}, "needs gpuq.io/retry-backoff-limit"),
                              ({"gpuq.io/retry-backoff-limit": "two"}, "gpuq.io/retry-backoff-limit")):
        bad = job_spec(JOB, job(annotations=given), queues, kube_cfg)
        assert isinstance(bad, Refusal) and bad.reason == "InvalidWorkload" and says in bad.message, bad


def test_each_pod_sets_node_selector_affinity_and_tolerations_reach_the_spec(queues: QueuesConfig,
                                                                            kube_cfg: KubernetesSource) -> None:
    affinity = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1", "z2"]},
                                  {"key": "spot", "operator": "DoesNotExist"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-9"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 20, "preference": {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["3"]}]}}]},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}
    obj = job()
    obj["spec"]["template"] = pod_template(nodeSelector={"pool": "a100"}, affinity=affinity, tolerations=[
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}])
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    (ps,) = spec.pod_sets
    assert ps.node_selector == {"pool": "a100"}
    assert ps.affinity is not None
    (first, by_name) = ps.affinity.required
    assert [r.describe() for r in first.match_expressions] == ["zone In [z1, z2]", "spot DoesNotExist"]
    assert by_name.matches({}, "gpu-9") and not by_name.matches({}, "gpu-1")
    # where the cluster has DRA nodes, each required term gets gpuq's own `gpuq.io/dra-driver DoesNotExist`: a GPU
    # pod set of a workload written in the cluster asks device-plugin GPUs, which such a node does not have
    spec = job_spec(JOB, obj, queues, kube_cfg, dra_nodes=True)
    assert not isinstance(spec, Refusal) and spec.pod_sets[0].affinity is not None
    (first, by_name) = spec.pod_sets[0].affinity.required
    assert [r.describe() for r in first.match_expressions] == ["zone In [z1, z2]", "spot DoesNotExist",
                                                               "gpuq.io/dra-driver DoesNotExist"]
    assert not by_name.matches({"gpuq.io/dra-driver": "gpu.nvidia.com"}, "gpu-9")
    assert [(p.weight, p.preference.describe()) for p in ps.affinity.preferred] == [(20, "gen Gt 3")]
    assert [t.key for t in ps.tolerations] == ["dedicated"] and spec.tolerations == ps.tolerations


def test_malformed_node_affinity_is_refused_naming_it(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    obj = job()
    obj["spec"]["template"] = pod_template(affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["new"]}]}]}}})
    refused = job_spec(JOB, obj, queues, kube_cfg)
    assert isinstance(refused, Refusal) and refused.reason == "InvalidWorkload"
    assert "gen Gt needs exactly one integer value" in refused.message


def test_a_part_of_a_gpu_is_read_from_annotations_and_the_shared_resource(queues: QueuesConfig,
                                                                          kube_cfg: KubernetesSource) -> None:
    from shared.domain import SharingMode

    # the renamed replica resource, the fraction on the template, the memory and isolation on the workload
    obj = job(annotations={"gpuq.io/gpu-memory-mib": "20480", "gpuq.io/gpu-sharing": "mps"})
    obj["spec"]["template"]["metadata"]["annotations"] = {"gpuq.io/gpu-fraction": "0.25"}
    obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu.shared": "1"}
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    (ps,) = spec.pod_sets
    assert (ps.gpu_fraction, ps.gpu_memory_mib, ps.gpu_sharing, ps.gpus) == (0.25, 20480, SharingMode.MPS, 0)
    assert ps.shared and spec.total_gpus == 0
    # nvidia.com/gpu: 1 (a time-sliced node advertises its replicas so) with a fraction is shared too
    obj = job(annotations={"gpuq.io/gpu-fraction": "0.5"})
    obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
    spec = job_spec(JOB, obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal) and spec.pod_sets[0].gpu_fraction == 0.5
    # the shared resource without saying which part, a malformed fraction, a fraction of 8 GPUs: refused, named
    obj = job()
    obj["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu.shared": "1"}
    refused = job_spec(JOB, obj, queues, kube_cfg)
    assert isinstance(refused, Refusal) and "asks nvidia.com/gpu.shared" in refused.message
    refused = job_spec(JOB, job(annotations={"gpuq.io/gpu-fraction": "quarter"}), queues, kube_cfg)
    assert isinstance(refused, Refusal) and "gpuq.io/gpu-fraction='quarter' is not a number" in refused.message
    refused = job_spec(JOB, job(annotations={"gpuq.io/gpu-fraction": "0.5"}), queues, kube_cfg)
    assert isinstance(refused, Refusal) and "set gpus_per_pod to 1" in refused.message


def test_gpu_pod_sets_of_cluster_workloads_stay_off_dra_nodes(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    spec = job_spec(JOB, job(), queues, kube_cfg, dra_nodes=True)
    assert not isinstance(spec, Refusal)
    (ps,) = spec.pod_sets
    assert ps.affinity is not None
    assert ps.affinity.required_matches({}, "n1")
    assert not ps.affinity.required_matches({"gpuq.io/dra-driver": "gpu.nvidia.com"}, "dra-1")
    cpu_only = job()
    cpu_only["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {}
    spec = job_spec(JOB, cpu_only, queues, kube_cfg, dra_nodes=True)
    assert not isinstance(spec, Refusal) and spec.pod_sets[0].affinity is None  # CPU pods may run there
    plain = job_spec(JOB, job(), queues, kube_cfg)  # no DRA node known: nothing added
    assert not isinstance(plain, Refusal) and plain.pod_sets[0].affinity is None
