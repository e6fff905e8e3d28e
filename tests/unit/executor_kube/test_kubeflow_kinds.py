"""TFJob (kubeflow.org/v1) and MPIJob (kubeflow.org/v2beta1), issue 48 item 7: their replica specs map to gpuq pod
sets, they suspend through runPolicy.suspend and finish by the kubeflow common conditions, and the intake takes them
in as it does a PyTorchJob."""

from __future__ import annotations

from typing import Any

from services.core.kube.admission import supported_resources
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig
from tests.unit.executor_kube.conftest import pod_template

TF = kind_of("kubeflow.org/v1", "TFJob")
MPI = kind_of("kubeflow.org/v2beta1", "MPIJob")


def tfjob(**replicas: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob",
            "metadata": {"name": "resnet", "namespace": "ml-a", "uid": "tf-uid", "labels": {"gpuq.io/queue": "team-a"}},
            "spec": {"runPolicy": {"suspend": True, "activeDeadlineSeconds": 3600}, "tfReplicaSpecs": replicas}}


def mpijob(workers: int = 2, gpus: int = 8) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
            "metadata": {"name": "allreduce", "namespace": "ml-a", "uid": "mpi-uid",
                         "labels": {"gpuq.io/queue": "team-a"}},
            "spec": {"slotsPerWorker": gpus, "runPolicy": {"suspend": True}, "mpiReplicaSpecs": {
                "Worker": {"replicas": workers, "template": pod_template(gpus)},
                "Launcher": {"replicas": 1, "template": pod_template(0)}}}}


def test_both_kinds_are_registered_and_judged_by_the_webhook() -> None:
    assert TF is not None and (TF.group, TF.version, TF.plural) == ("kubeflow.org", "v1", "tfjobs")
    assert MPI is not None and (MPI.group, MPI.version, MPI.plural) == ("kubeflow.org", "v2beta1", "mpijobs")
    assert {("kubeflow.org", "v1", "tfjobs"), ("kubeflow.org", "v2beta1", "mpijobs")} <= set(supported_resources())


def test_tfjob_replica_types_become_pod_sets_chief_first() -> None:
    assert TF is not None
    obj = tfjob(Worker={"replicas": 4, "template": pod_template(8)}, PS={"replicas": 2, "template": pod_template(0)},
                Evaluator={"template": pod_template(1)}, Chief={"replicas": 1, "template": pod_template(8)})
    assert [(p.name, p.count) for p in TF.pod_sets(obj)] == [("chief", 1), ("ps", 2), ("worker", 4),
                                                             ("evaluator", 1)]
    assert TF.suspended(obj) and TF.active_deadline_s(obj) == 3600
    assert TF.suspend_patch(False) == {"spec": {"runPolicy": {"suspend": False}}}
    placed = {"metadata": {"labels": {"gpuq.io/pod-set": "worker"}}, "spec": {"nodeSelector": {"a": "b"}}}
    patch = TF.run_patch(obj, {"worker": placed})
    assert patch["spec"]["tfReplicaSpecs"]["Worker"]["template"] == placed
    assert patch["spec"]["tfReplicaSpecs"]["PS"]["template"] == pod_template(0)
    assert patch["spec"]["runPolicy"] == {"suspend": False, "activeDeadlineSeconds": 3600}


def test_mpijob_launcher_and_workers_suspend_through_run_policy() -> None:
    assert MPI is not None
    obj = mpijob(workers=2)
    assert [(p.name, p.count) for p in MPI.pod_sets(obj)] == [("launcher", 1), ("worker", 2)]
    assert MPI.suspended(obj) and not MPI.stopped(obj)
    patch = MPI.run_patch(obj, {"launcher": {"spec": {"x": 1}}}, suspend=True)
    assert patch["spec"]["mpiReplicaSpecs"]["Launcher"]["template"] == {"spec": {"x": 1}}
    assert patch["spec"]["runPolicy"] == {"suspend": True}


def test_finish_and_stop_read_the_kubeflow_conditions() -> None:
    assert TF is not None and MPI is not None
    for kind, obj in ((TF, tfjob(Worker={"template": pod_template()})), (MPI, mpijob())):
        assert kind.finished(obj) is None
        obj["status"] = {"conditions": [{"type": "Suspended", "status": "True", "reason": "JobSuspended"}]}
        assert kind.stopped(obj)
        obj["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"})
        finish = kind.finished(obj)
        assert finish is not None and not finish.succeeded and finish.reason == "BackoffLimitExceeded"
        end = kind.conclusion(obj, "PreemptedByGpuq", "m", "2026-12-06T00:00:00Z")
        assert end.status and end.patch["status"]["conditions"][-1]["reason"] == "PreemptedByGpuq"


def test_intake_takes_both_in_with_the_gpus_of_every_replica_type(queues: QueuesConfig,
                                                                  kube_cfg: KubernetesSource) -> None:
    assert TF is not None and MPI is not None
    spec = job_spec(MPI, mpijob(workers=2, gpus=8), queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("launcher", 1, 0), ("worker", 2, 8)]
    assert spec.total_gpus == 16 and spec.workload is not None and spec.workload.key == "MPIJob/ml-a/allreduce"
    tf = job_spec(TF, tfjob(Chief={"template": pod_template(8)}, Worker={"replicas": 3, "template": pod_template(8)}),
                  queues, kube_cfg)
    assert not isinstance(tf, Refusal)
    assert [(p.name, p.count) for p in tf.pod_sets] == [("chief", 1), ("worker", 3)] and tf.total_gpus == 32
    assert tf.max_runtime_s == 3600
