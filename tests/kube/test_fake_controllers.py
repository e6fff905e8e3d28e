"""The test-side workload controllers: suspend semantics, pod naming and labels, completion and failure conditions."""

from __future__ import annotations

from typing import Any

from lightkube.resources.batch_v1 import Job
from lightkube.types import PatchType

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.kinds import JobSet, PyTorchJob, RayJob
from tests.kube.kubefake.resources import JOBS, JOBSETS, NODES, PODS, PYTORCHJOBS, RAYCLUSTERS, RAYJOBS, SERVICES
from tests.kube.kubefake.store import get_condition

NS = "default"


def job(
    name: str, *, suspend: bool = True, completions: int = 1, parallelism: int = 1, indexed: bool = False, **spec: Any
) -> Job:
    body: dict[str, Any] = {
        "suspend": suspend,
        "completions": completions,
        "parallelism": parallelism,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "train", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                ],
            }
        },
        **spec,
    }
    if indexed:
        body["completionMode"] = "Indexed"
    return Job.from_dict({"metadata": {"name": name, "namespace": NS}, "spec": body})


def condition(obj: dict[str, Any], kind: str) -> tuple[str | None, str | None]:
    found = get_condition(obj, kind) or {}
    return found.get("status"), found.get("reason")


async def test_a_suspended_job_has_no_pods_and_unsuspending_uses_the_template_as_it_is_then(
    kube_api: KubeCluster,
) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    fake.add_node("n2", gpus=8)
    client = kube_api.client()
    await client.create(job("j", completions=2, parallelism=2, indexed=True))
    await fake.settle()
    assert fake.store.list(PODS, NS) == []
    assert condition(fake.store.get(JOBS, NS, "j"), "Suspended") == ("True", "JobSuspended")
    placement = {"spec": {"suspend": False, "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": "n2"}}}}}
    await client.patch(Job, "j", placement, namespace=NS, patch_type=PatchType.STRATEGIC)
    pods = await kube_api.run_pods_to_ready(NS, "batch.kubernetes.io/job-name=j", count=2)
    assert sorted(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in pods) == ["0", "1"]
    assert {p["spec"]["nodeName"] for p in pods} == {"n2"}
    for p in pods:
        index = p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        assert p["metadata"]["name"].startswith(f"j-{index}-")
        assert p["metadata"]["ownerReferences"][0]["kind"] == "Job"
        env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
        assert (
            env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        )
    resumed = fake.store.get(JOBS, NS, "j")
    assert condition(resumed, "Suspended") == ("False", "JobResumed")
    assert resumed["status"]["active"] == 2 and resumed["status"]["ready"] == 2 and resumed["status"]["startTime"]


async def test_suspending_a_running_job_deletes_its_pods_without_counting_failures(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    client = kube_api.client()
    await client.create(job("j", suspend=False, completions=3, parallelism=3))
    await kube_api.run_pods_to_ready(NS, "batch.kubernetes.io/job-name=j", count=3)
    await client.patch(Job, "j", {"spec": {"suspend": True}}, namespace=NS)
    await fake.settle()
    assert fake.store.list(PODS, NS) == []
    suspended = fake.store.get(JOBS, NS, "j")
    assert condition(suspended, "Suspended") == ("True", "JobSuspended")
    assert not suspended["status"].get("failed") and "startTime" not in suspended["status"]
    assert not suspended["status"].get("active")


async def test_a_job_completes_when_every_index_succeeded(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    await kube_api.client().create(job("j", suspend=False, completions=2, parallelism=2, indexed=True))
    await kube_api.run_pods_to_ready(NS, "batch.kubernetes.io/job-name=j", count=2)
    await kube_api.complete_pods(NS, "batch.kubernetes.io/job-name=j")
    await fake.settle()
    done = fake.store.get(JOBS, NS, "j")
    assert condition(done, "Complete") == ("True", "CompletionsReached")
    assert done["status"]["succeeded"] == 2 and done["status"]["completedIndexes"] == "0-1"
    assert all(
        "batch.kubernetes.io/job-tracking" not in (p["metadata"].get("finalizers") or [])
        for p in fake.store.list(PODS, NS)
    )


async def test_backoff_limit_and_active_deadline_fail_the_job_with_their_reasons(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("n1", gpus=8)
    client = kube_api.client()
    await client.create(job("flaky", suspend=False, backoffLimit=1))
    for _ in range(2):
        [pod] = [p for p in await kube_api.run_pods_to_ready(NS, "batch.kubernetes.io/job-name=flaky")]
        fake.kubelet.oom_kill(NS, pod["metadata"]["name"])
        await fake.settle()
    flaky = fake.store.get(JOBS, NS, "flaky")
    assert condition(flaky, "Failed") == ("True", "BackoffLimitExceeded") and flaky["status"]["failed"] == 2

    await client.create(job("slow", suspend=False, activeDeadlineSeconds=600))
    await kube_api.run_pods_to_ready(NS, "batch.kubernetes.io/job-name=slow")
    fake.advance(590)  # the fake clock follows the wall clock too: leave room for the seconds this test takes
    assert condition(fake.store.get(JOBS, NS, "slow"), "Failed") == (None, None)
    fake.advance(10)
    slow = fake.store.get(JOBS, NS, "slow")
    assert condition(slow, "Failed") == ("True", "DeadlineExceeded")
    assert [p for p in fake.store.list(PODS, NS) if p["metadata"]["labels"].get("job-name") == "slow"] == []


def pytorchjob(name: str, workers: int = 2, gpus: int = 8, suspend: bool = True) -> Any:
    template = {
        "spec": {
            "containers": [
                {"name": "pytorch", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            ]
        }
    }
    return PyTorchJob.from_dict(
        {
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "runPolicy": {"suspend": suspend},
                "pytorchReplicaSpecs": {
                    "Master": {"replicas": 1, "restartPolicy": "Never", "template": template},
                    "Worker": {"replicas": workers, "restartPolicy": "Never", "template": template},
                },
            },
        }
    )


async def test_pytorchjob_suspend_resume_and_success(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2", "n3"):
        fake.add_node(node, gpus=8)
    client = kube_api.client()
    await client.create(pytorchjob("pt"))
    await fake.settle()
    assert fake.store.list(PODS, NS) == []
    assert condition(fake.store.get(PYTORCHJOBS, NS, "pt"), "Suspended") == ("True", "PyTorchJobSuspended")
    await client.patch(
        PyTorchJob, "pt", {"spec": {"runPolicy": {"suspend": False}}}, namespace=NS, patch_type=PatchType.MERGE
    )
    pods = await kube_api.run_pods_to_ready(NS, "training.kubeflow.org/job-name=pt", count=3)
    by_name = {p["metadata"]["name"]: p for p in pods}
    assert sorted(by_name) == ["pt-master-0", "pt-worker-0", "pt-worker-1"]
    worker = by_name["pt-worker-1"]
    assert worker["metadata"]["labels"]["training.kubeflow.org/replica-type"] == "worker"
    assert worker["metadata"]["labels"]["training.kubeflow.org/replica-index"] == "1"
    assert by_name["pt-master-0"]["metadata"]["labels"]["training.kubeflow.org/job-role"] == "master"
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env == {
        "MASTER_PORT": "23456",
        "MASTER_ADDR": "pt-master-0",
        "WORLD_SIZE": "3",
        "RANK": "2",
        "PYTHONUNBUFFERED": "1",
    }
    assert len(fake.store.list(SERVICES, NS)) == 3
    running = fake.store.get(PYTORCHJOBS, NS, "pt")
    assert condition(running, "Running") == ("True", "PyTorchJobRunning")
    assert condition(running, "Suspended") == ("False", "PyTorchJobResumed")

    # Suspending again deletes the pods; resuming recreates them.
    await client.patch(
        PyTorchJob, "pt", {"spec": {"runPolicy": {"suspend": True}}}, namespace=NS, patch_type=PatchType.MERGE
    )
    await fake.settle()
    assert fake.store.list(PODS, NS) == []
    await client.patch(
        PyTorchJob, "pt", {"spec": {"runPolicy": {"suspend": False}}}, namespace=NS, patch_type=PatchType.MERGE
    )
    await kube_api.run_pods_to_ready(NS, "training.kubeflow.org/job-name=pt", count=3)
    await kube_api.complete_pods(NS, "training.kubeflow.org/job-name=pt")
    await fake.settle()
    done = fake.store.get(PYTORCHJOBS, NS, "pt")
    assert condition(done, "Succeeded") == ("True", "PyTorchJobSucceeded")
    assert condition(done, "Running")[0] == "False"


async def test_pytorchjob_fails_when_a_pod_fails(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2"):
        fake.add_node(node, gpus=8)
    await kube_api.client().create(pytorchjob("pt", workers=1, suspend=False))
    await kube_api.run_pods_to_ready(NS, "training.kubeflow.org/job-name=pt", count=2)
    fake.kubelet.oom_kill(NS, "pt-worker-0")
    await fake.settle()
    failed = fake.store.get(PYTORCHJOBS, NS, "pt")
    assert condition(failed, "Failed") == ("True", "PyTorchJobFailed")
    assert "Worker replica(s) failed" in (get_condition(failed, "Failed") or {})["message"]


def jobset(name: str, suspend: bool = True, max_restarts: int = 0) -> Any:
    def replicated(job_name: str, replicas: int) -> dict[str, Any]:
        job_spec = {"parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": pod_spec}}
        return {"name": job_name, "replicas": replicas, "template": {"spec": job_spec}}

    pod_spec = {
        "restartPolicy": "Never",
        "containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
    }
    return JobSet.from_dict(
        {
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "suspend": suspend,
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [replicated("driver", 1), replicated("workers", 2)],
            },
        }
    )


async def test_jobset_child_jobs_suspend_propagation_and_completion(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2", "n3"):
        fake.add_node(node, gpus=8, labels={"rack": "r1" if node != "n3" else "r2"})
    client = kube_api.client()
    await client.create(jobset("js"))
    await fake.settle()
    children = {j["metadata"]["name"]: j for j in fake.store.list(JOBS, NS)}
    assert sorted(children) == ["js-driver-0", "js-workers-0", "js-workers-1"]
    assert all(j["spec"]["suspend"] for j in children.values())
    worker = children["js-workers-1"]
    assert worker["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == "js"
    assert worker["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"] == "workers"
    assert worker["metadata"]["labels"]["jobset.sigs.k8s.io/job-index"] == "1"
    assert worker["metadata"]["labels"]["jobset.sigs.k8s.io/job-global-index"] == "2"
    assert worker["spec"]["completionMode"] == "Indexed"
    assert worker["spec"]["template"]["spec"]["subdomain"] == "js"
    assert fake.store.list(PODS, NS) == []
    assert condition(fake.store.get(JOBSETS, NS, "js"), "Suspended") == ("True", "SuspendedJobs")

    # Placement is written into the JobSet's templates; resuming carries it into the child Jobs, then their pods.
    placed = fake.store.get(JOBSETS, NS, "js")
    for replicated in placed["spec"]["replicatedJobs"]:
        replicated["template"]["spec"]["template"]["spec"]["nodeSelector"] = {"rack": "r1"}
    placed["spec"]["suspend"] = False
    await client.replace(JobSet.from_dict(placed))
    pods = await kube_api.run_pods_to_ready(NS, "jobset.sigs.k8s.io/jobset-name=js", count=2)
    assert {p["spec"]["nodeName"] for p in pods} == {"n1", "n2"}  # the third pod does not fit in rack r1
    assert condition(fake.store.get(JOBSETS, NS, "js"), "Suspended") == ("False", "ResumeJobs")

    # Suspending again suspends every child Job, whose pods go.
    await client.patch(JobSet, "js", {"spec": {"suspend": True}}, namespace=NS, patch_type=PatchType.MERGE)
    await fake.settle()
    assert fake.store.list(PODS, NS) == [] and all(j["spec"]["suspend"] for j in fake.store.list(JOBS, NS))

    await client.patch(JobSet, "js", {"spec": {"suspend": False}}, namespace=NS, patch_type=PatchType.MERGE)
    await kube_api.run_pods_to_ready(NS, "jobset.sigs.k8s.io/jobset-name=js", count=2)
    fake.store.mutate(NODES, None, "n3", lambda n: n["metadata"]["labels"].__setitem__("rack", "r1"))
    await kube_api.run_pods_to_ready(NS, "jobset.sigs.k8s.io/jobset-name=js", count=3)
    await kube_api.complete_pods(NS, "jobset.sigs.k8s.io/jobset-name=js")
    await fake.settle()
    done = fake.store.get(JOBSETS, NS, "js")
    assert (
        condition(done, "Completed") == ("True", "AllJobsCompleted") and done["status"]["terminalState"] == "Completed"
    )
    assert {r["name"]: r["succeeded"] for r in done["status"]["replicatedJobsStatus"]} == {"driver": 1, "workers": 2}


async def test_jobset_restarts_then_fails(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2", "n3"):
        fake.add_node(node, gpus=8)
    await kube_api.client().create(jobset("js", suspend=False, max_restarts=1))
    first = await kube_api.run_pods_to_ready(NS, "jobset.sigs.k8s.io/jobset-name=js", count=3)
    fake.kubelet.oom_kill(NS, first[0]["metadata"]["name"])
    await fake.settle()
    restarted = fake.store.get(JOBSETS, NS, "js")
    assert restarted["status"]["restarts"] == 1 and condition(restarted, "Failed") == (None, None)
    second = await kube_api.run_pods_to_ready(NS, "jobset.sigs.k8s.io/restart-attempt=1", count=3)
    fake.kubelet.finish(NS, second[0]["metadata"]["name"], exit_code=1)
    await fake.settle()
    failed = fake.store.get(JOBSETS, NS, "js")
    assert (
        condition(failed, "Failed") == ("True", "ReachedMaxRestarts") and failed["status"]["terminalState"] == "Failed"
    )


def rayjob(name: str, suspend: bool = True) -> Any:
    def template(gpus: int) -> dict[str, Any]:
        return {
            "spec": {
                "containers": [
                    {
                        "name": "ray",
                        "image": "rayproject/ray:2.9",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                    }
                ]
            }
        }

    return RayJob.from_dict(
        {
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "suspend": suspend,
                "entrypoint": "python train.py",
                "shutdownAfterJobFinishes": True,
                "rayClusterSpec": {
                    "headGroupSpec": {"template": template(0)},
                    "workerGroupSpecs": [{"groupName": "gpu", "replicas": 2, "template": template(8)}],
                },
            },
        }
    )


async def test_rayjob_suspend_resume_pods_and_outcome(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    for node in ("n1", "n2"):
        fake.add_node(node, gpus=8)
    client = kube_api.client()
    await client.create(rayjob("rj"))
    await fake.settle()
    assert fake.store.list(PODS, NS) == []
    assert fake.store.get(RAYJOBS, NS, "rj")["status"]["jobDeploymentStatus"] == "Suspended"
    await client.patch(RayJob, "rj", {"spec": {"suspend": False}}, namespace=NS, patch_type=PatchType.MERGE)
    await fake.settle()
    status = fake.store.get(RAYJOBS, NS, "rj")["status"]
    cluster_name = status["rayClusterName"]
    assert cluster_name.startswith("rj-raycluster-")
    pods = await kube_api.run_pods_to_ready(NS, f"ray.io/cluster={cluster_name}", count=3)
    kinds = sorted((p["metadata"]["labels"]["ray.io/node-type"], p["metadata"]["labels"]["ray.io/group"]) for p in pods)
    assert kinds == [("head", "headgroup"), ("worker", "gpu"), ("worker", "gpu")]
    assert all(
        p["metadata"]["name"].startswith(f"{cluster_name}-gpu-worker-")
        for p in pods
        if p["metadata"]["labels"]["ray.io/node-type"] == "worker"
    )
    await fake.settle()
    assert fake.store.get(RAYJOBS, NS, "rj")["status"]["jobDeploymentStatus"] == "Running"

    await client.patch(RayJob, "rj", {"spec": {"suspend": True}}, namespace=NS, patch_type=PatchType.MERGE)
    await fake.settle()
    assert fake.store.list(PODS, NS) == [] and fake.store.list(RAYCLUSTERS, NS) == []
    await client.patch(RayJob, "rj", {"spec": {"suspend": False}}, namespace=NS, patch_type=PatchType.MERGE)
    await fake.settle()
    new_cluster = fake.store.get(RAYJOBS, NS, "rj")["status"]["rayClusterName"]
    assert new_cluster != cluster_name
    await kube_api.run_pods_to_ready(NS, f"ray.io/cluster={new_cluster}", count=3)
    await kube_api.complete_pods(NS, f"ray.io/cluster={new_cluster},ray.io/node-type=head")
    await fake.settle()
    done = fake.store.get(RAYJOBS, NS, "rj")["status"]
    assert (done["jobDeploymentStatus"], done["jobStatus"]) == ("Complete", "SUCCEEDED")
    assert fake.store.list(RAYCLUSTERS, NS) == []  # shutdownAfterJobFinishes
