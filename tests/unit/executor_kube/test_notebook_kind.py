"""Kubeflow Notebook (kubeflow.org/v1), issue 48: one pod set `notebook`, in job class notebook; stopped and started
through `kubeflow-resource-stopped`; gpuq's pod-template keys written on the Notebook itself (its template is a spec
only, and the notebook controller copies the Notebook's labels and annotations to the pod) and removed when it is
given back; the webhook stops one created running and records its user without one patch undoing the other."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch

from services.core.kube.admission import Review, WebhookPolicy, mutate, response, supported_resources
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from services.core.kube.placement import placed_template, restored_template
from shared.config import KubernetesSource, QueuesConfig
from shared.domain import JobKind
from tests.unit.executor_kube.conftest import pod_template

NB = kind_of("kubeflow.org/v1", "Notebook")
STOPPED = "kubeflow-resource-stopped"


def notebook(stopped: bool = True, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    held = {STOPPED: "2026-12-06T07:00:00Z"} if stopped else {}
    return {"apiVersion": "kubeflow.org/v1", "kind": "Notebook",
            "metadata": {"name": "lab", "namespace": "ml-a", "uid": "nb-uid", "labels": {"gpuq.io/queue": "team-a"},
                         "annotations": {**held, **(annotations or {})}},
            "spec": {"template": {"spec": pod_template(8)["spec"]}}}


def test_registered_judged_by_the_webhook_and_taken_in_as_a_notebook(queues: QueuesConfig,
                                                                      kube_cfg: KubernetesSource) -> None:
    assert NB is not None and ("kubeflow.org", "v1", "notebooks") in supported_resources()
    spec = job_spec(NB, notebook(), queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert spec.kind is JobKind.NOTEBOOK and [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [
        ("notebook", 1, 8)]
    trained = job_spec(NB, notebook(annotations={"gpuq.io/kind": "training"}), queues, kube_cfg)
    assert not isinstance(trained, Refusal) and trained.kind is JobKind.TRAINING  # the annotation still decides


def test_stopped_and_started_through_kubeflows_annotation() -> None:
    assert NB is not None
    obj = notebook()
    assert NB.suspended(obj) and NB.stopped(obj) and NB.finished(obj) is None
    assert not NB.suspended(notebook(stopped=False))
    assert not NB.stopped({**obj, "status": {"readyReplicas": 1}})  # the controller has not scaled it to 0 yet
    assert NB.suspend_patch(False) == {"metadata": {"annotations": {STOPPED: None}}}


def test_gpuqs_template_keys_go_on_the_notebook_and_come_off_when_it_is_given_back() -> None:
    assert NB is not None
    obj = notebook()
    (ps,) = NB.pod_sets(obj)
    placed = placed_template(ps.template, job_id="ml-a.lab.nb-uid", pod_set="notebook", nodes=["n1"],
                             resume_from="s3://ckpt/1")
    patch = NB.run_patch(obj, {"notebook": placed})
    assert patch["metadata"]["annotations"][STOPPED] is None  # started
    assert patch["metadata"]["labels"]["gpuq.io/pod-set"] == "notebook"
    assert patch["metadata"]["annotations"]["gpuq.io/resume-from"] == "s3://ckpt/1"
    assert patch["spec"]["template"]["spec"]["schedulingGates"] == [{"name": "gpuq.io/placement"}]
    running = _merge(obj, patch)
    (again,) = NB.pod_sets(running)  # the pod set as gpuq reads it back: its keys are the template's
    assert again.template["metadata"]["labels"]["gpuq.io/job"] == placed["metadata"]["labels"]["gpuq.io/job"]
    back = NB.run_patch(running, {"notebook": restored_template(ps.template)}, suspend=True)
    given_back = _merge(running, back)
    assert STOPPED in given_back["metadata"]["annotations"]
    assert not [k for k in {**given_back["metadata"]["labels"], **given_back["metadata"]["annotations"]}
                if k in ("gpuq.io/job", "gpuq.io/pod-set", "gpuq.io/job-id", "gpuq.io/resume-from")]
    assert given_back["metadata"]["labels"]["gpuq.io/queue"] == "team-a"
    assert not given_back["spec"]["template"]["spec"].get("schedulingGates")


def test_the_webhook_stops_a_notebook_created_running_and_records_its_user(queues: QueuesConfig) -> None:
    obj = notebook(stopped=False)
    del obj["metadata"]["annotations"]  # no annotations at all: both keys land in one missing map
    review = Review(uid="u", operation="CREATE", group="kubeflow.org", version="v1", kind="Notebook",
                    namespace="ml-a", user="alice", obj=obj, old=None)
    answer = response("u", mutate(review, WebhookPolicy(queues=queues)))["response"]
    ops = json.loads(base64.b64decode(answer["patch"]))
    after = jsonpatch.apply_patch(obj, ops)
    assert after["metadata"]["annotations"] == {STOPPED: "gpuq", "gpuq.io/user": "alice"}


def _merge(obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch."""
    out = json.loads(json.dumps(obj))

    def merge(into: dict[str, Any], p: dict[str, Any]) -> None:
        for k, v in p.items():
            if v is None:
                into.pop(k, None)
            elif isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = json.loads(json.dumps(v))

    merge(out, patch)
    return out
