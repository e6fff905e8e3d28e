"""StatefulSet (apps/v1), issue 48: one pod set `main` of the pods it runs, held at 0 replicas with the pods to run in
`gpuq.io/replicas`, started with them back; the webhook holds a GPU StatefulSet created running in a managed
namespace and leaves alone one another supported workload controls (a Notebook's) and a CPU one."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch

from services.core.kube.admission import Review, WebhookPolicy, mutate, response, supported_resources
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig
from shared.domain import JobKind
from tests.unit.executor_kube.conftest import pod_template

STS = kind_of("apps/v1", "StatefulSet")


def sts(replicas: int = 0, annotations: dict[str, str] | None = None, gpus: int = 8) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "serve", "namespace": "ml-a", "uid": "sts-uid", "labels": {"gpuq.io/queue": "team-a"},
                         "annotations": {"gpuq.io/replicas": "3"} if annotations is None else annotations},
            "spec": {"replicas": replicas, "serviceName": "serve", "template": pod_template(gpus)}}


def test_held_taken_in_and_started_with_its_replicas_back(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    assert STS is not None and ("apps", "v1", "statefulsets") in supported_resources()
    spec = job_spec(STS, sts(annotations={"gpuq.io/replicas": "3", "gpuq.io/kind": "inference"}), queues, kube_cfg)
    assert not isinstance(spec, Refusal) and spec.kind is JobKind.INFERENCE
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("main", 3, 8)]
    held = sts()
    assert STS.suspended(held) and STS.stopped(held) and STS.finished(held) is None
    assert not STS.stopped({**held, "status": {"replicas": 2}})
    assert STS.run_patch(held, {"main": {"spec": {"x": 1}}})["spec"] == {
        "replicas": 3, "serviceName": "serve", "template": {"spec": {"x": 1}}}
    assert STS.run_patch(sts(replicas=3), {}, suspend=True)["spec"]["replicas"] == 0


def review(obj: dict[str, Any]) -> Review:
    return Review(uid="u", operation="CREATE", group="apps", version="v1", kind="StatefulSet", namespace="ml-a",
                  user="alice", obj=obj, old=None)


def test_the_webhook_holds_a_gpu_statefulset_and_leaves_a_notebooks_and_a_cpu_one(queues: QueuesConfig) -> None:
    policy = WebhookPolicy(queues=queues)
    running = sts(replicas=2, annotations={})
    del running["metadata"]["labels"]
    answer = response("u", mutate(review(running), policy))["response"]
    after = jsonpatch.apply_patch(running, json.loads(base64.b64decode(answer["patch"])))
    assert after["spec"]["replicas"] == 0 and after["metadata"]["labels"] == {"gpuq.io/queue": "team-a"}
    assert after["metadata"]["annotations"] == {"gpuq.io/replicas": "2", "gpuq.io/user": "alice"}
    notebooks = json.loads(json.dumps(running))
    notebooks["metadata"]["ownerReferences"] = [{"apiVersion": "kubeflow.org/v1", "kind": "Notebook", "name": "lab",
                                                 "uid": "nb", "controller": True}]
    assert not mutate(review(notebooks), policy).patch
    cpu = sts(replicas=2, annotations={}, gpus=0)
    del cpu["metadata"]["labels"]
    assert not mutate(review(cpu), policy).patch
