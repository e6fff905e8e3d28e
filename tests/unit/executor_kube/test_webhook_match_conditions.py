"""The webhook configurations' CEL matchConditions (the chart's text, tests/kube_support.py) send gpuq every request
its rules act on (core/admission.py: a mutation, or a refusal), and leave out a CPU workload or pod that carries no
gpuq.io/ key. Evaluated with a real CEL implementation (cel-python, as the fake API server does), per kind, on
creates and on updates."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.core.kube.admission import Review, WebhookPolicy, mutate, validate
from services.core.kube.kinds import kind_of
from shared.config import parse_queues
from tests.kube.kubefake import cel
from tests.kube_support import POD_CONDITION, kind_body, template, workload_condition
from tests.unit.executor_kube.conftest import QUEUES

POLICY = WebhookPolicy(queues=parse_queues({**QUEUES, "governance": {"default": {
    "allowed_images": ["ghcr.io/example"]}}}))
USER = "system:serviceaccount:ml-a:alice"
KINDS = {"Job": ("batch", "v1", "jobs"), "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
         "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"), "TFJob": ("kubeflow.org", "v1", "tfjobs"),
         "MPIJob": ("kubeflow.org", "v2beta1", "mpijobs"), "RayJob": ("ray.io", "v1", "rayjobs"),
         "Notebook": ("kubeflow.org", "v1", "notebooks"),
         "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
         "StatefulSet": ("apps", "v1", "statefulsets")}
Obj = dict[str, Any]
RUN_POLICY = ("PyTorchJob", "TFJob", "MPIJob")  # suspended through spec.runPolicy.suspend


def review(kind: str, operation: str, obj: Obj, old: Obj | None = None) -> Review:
    group, version = KINDS[kind][:2] if kind in KINDS else ("", "v1")
    return Review(uid="u", operation=operation, group=group, version=version, kind=kind, namespace="ml-a",
                  user=USER, obj=obj, old=old)


def sent(expression: str, r: Review) -> bool:
    request = {"operation": r.operation, "namespace": r.namespace, "userInfo": {"username": r.user},
               "kind": {"group": r.group, "version": r.version, "kind": r.kind}}
    return cel.evaluate(expression, r.obj, r.old, request)


def acted_on(r: Review) -> bool:
    """Whether gpuq's rules do anything with the request: patch it (mutation) or refuse it (validation)."""
    return bool(mutate(r, POLICY).patch) or not validate(r, POLICY).allowed


def templates_of(kind: str, obj: Obj) -> list[Obj]:
    found = kind_of(obj["apiVersion"], kind)
    assert found is not None
    return [ps.template for ps in found.all_templates(obj)]  # the object's own template dicts


def template_meta_of(kind: str, obj: Obj, index: int) -> Obj:
    """Where a pod template's metadata is written: the template, or for a Notebook (whose template is a spec only) the
    Notebook itself, whose labels and annotations the notebook controller copies to its pod."""
    return obj if kind == "Notebook" else templates_of(kind, obj)[index]


def suspend(kind: str, obj: Obj, value: bool) -> Obj:
    out = copy.deepcopy(obj)
    if kind == "Notebook":  # stopped as Kubeflow stops one
        annotations = meta(out, "annotations")
        annotations.pop("kubeflow-resource-stopped", None)
        if value:
            annotations["kubeflow-resource-stopped"] = "2026-12-06T07:00:00Z"
        return out
    if kind in ("LeaderWorkerSet", "StatefulSet"):  # held at zero groups / replicas
        out["spec"]["replicas"] = 0 if value else 1
        return out
    (out["spec"].setdefault("runPolicy", {}) if kind in RUN_POLICY else out["spec"])["suspend"] = value
    return out


def edit(obj: Obj, change: Callable[[Obj], None]) -> Obj:
    out = copy.deepcopy(obj)
    change(out)
    return out


def meta(obj: Obj, what: str) -> dict[str, str]:
    labels: dict[str, str] = obj.setdefault("metadata", {}).setdefault(what, {})
    return labels


def creates(kind: str) -> Iterator[tuple[str, Obj]]:
    for gpu in (False, True):
        base = kind_body(kind, "w", gpu)
        yield f"gpu={gpu}", base
        yield f"gpu={gpu}, suspended", suspend(kind, base, True)
        for queue in ("team-a", "team-b"):
            yield f"gpu={gpu}, queue {queue}", edit(base, lambda o, q=queue: meta(o, "labels").update(
                {"gpuq.io/queue": q}))
        yield f"gpu={gpu}, job-id annotation", edit(base, lambda o: meta(o, "annotations").update(
            {"gpuq.io/job-id": "ml-a.x.1"}))
        yield f"gpu={gpu}, status label", edit(base, lambda o: meta(o, "labels").update({"gpuq.io/status": "x"}))
        yield f"gpu={gpu}, last template label", edit(base, lambda o: meta(template_meta_of(kind, o, -1), "labels")
                                                      .update({"gpuq.io/job": "ml-a.x.1"}))
        yield f"gpu={gpu}, last template annotation", edit(
            base, lambda o: meta(template_meta_of(kind, o, -1), "annotations").update({"gpuq.io/resume": "s"}))
    if kind == "RayJob":  # the submitter pod KubeRay runs is a template too
        yield "GPU in the submitter only", edit(kind_body(kind, "w", False), lambda o: o["spec"].update(
            {"submitterPodTemplate": template(1)}))


def updates(kind: str) -> Iterator[tuple[str, Obj, Obj]]:
    for gpu in (False, True):
        managed = edit(suspend(kind, kind_body(kind, "w", gpu), True), lambda o: (
            meta(o, "labels").update({"gpuq.io/queue": "team-a"}),
            meta(o, "annotations").update({"gpuq.io/user": USER, "gpuq.io/job-id": "ml-a.w.1"})))
        yield f"gpu={gpu}: resumed", managed, suspend(kind, managed, False)
        yield f"gpu={gpu}: job id removed", managed, edit(managed, lambda o: meta(o, "annotations").pop(
            "gpuq.io/job-id"))
        yield f"gpu={gpu}: every gpuq key removed and resumed", managed, edit(suspend(kind, managed, False), lambda o: (
            meta(o, "labels").clear(), meta(o, "annotations").clear()))
        yield f"gpu={gpu}: template label added", managed, edit(managed, lambda o: meta(
            template_meta_of(kind, o, 0), "labels").update({"gpuq.io/job": "ml-a.y.1"}))
        stamped = edit(managed, lambda o: meta(template_meta_of(kind, o, -1), "labels").update({"gpuq.io/job": "j"}))
        yield f"gpu={gpu}: template label removed", stamped, edit(stamped, lambda o: meta(
            template_meta_of(kind, o, -1), "labels").pop("gpuq.io/job"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_workload_request_gpuq_acts_on_is_sent_to_it(kind: str) -> None:
    expression = workload_condition(KINDS[kind][2])["expression"]
    acted = 0
    for what, obj in creates(kind):
        r = review(kind, "CREATE", obj)
        if acted_on(r):
            acted += 1
            assert sent(expression, r), f"CREATE {kind} ({what}) is judged by gpuq but not sent to it"
    for what, old, new in updates(kind):
        r = review(kind, "UPDATE", new, old)
        if acted_on(r):
            acted += 1
            assert sent(expression, r), f"UPDATE {kind} ({what}) is judged by gpuq but not sent to it"
    assert acted >= 10  # the cases do reach the rules


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cpu_workload_without_gpuq_keys_is_not_sent(kind: str) -> None:
    expression = workload_condition(KINDS[kind][2])["expression"]
    cpu = kind_body(kind, "w", gpu=False)
    assert not sent(expression, review(kind, "CREATE", cpu))
    assert not sent(expression, review(kind, "UPDATE", suspend(kind, cpu, True), cpu))
    assert sent(expression, review(kind, "CREATE", kind_body(kind, "w", gpu=True)))


def gpu_pod(gated: bool, gpus: int = 1) -> Obj:
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **template(gpus)}
    if gated:
        body["spec"]["schedulingGates"] = [{"name": "gpuq.io/placement"}]
    return body


def test_every_pod_request_gpuq_acts_on_is_sent_to_it_and_no_cpu_pod() -> None:
    expression = POD_CONDITION["expression"]
    cases = [("CREATE", gpu_pod(False), None), ("CREATE", gpu_pod(True), None),
             ("UPDATE", gpu_pod(False), gpu_pod(True)), ("UPDATE", gpu_pod(True), gpu_pod(True))]
    acted = [r for r in (review("Pod", op, obj, old) for op, obj, old in cases) if acted_on(r)]
    assert len(acted) == 2  # the bare GPU pod, and its gate removed
    assert all(sent(expression, r) for r in acted)
    init_only = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **template(init_gpus=1)}
    assert sent(expression, review("Pod", "CREATE", init_only))
    for cpu in (gpu_pod(False, gpus=0), gpu_pod(True, gpus=0)):
        assert not sent(expression, review("Pod", "CREATE", cpu))
        assert not sent(expression, review("Pod", "UPDATE", cpu, cpu))


def test_an_object_without_the_fields_the_conditions_read_evaluates_without_error() -> None:
    """A malformed object (no spec, no templates, no containers) is judged false, not an evaluation error: an error
    would refuse the request under failurePolicy Fail even while gpuq is up."""
    for kind, (_, _, plural) in KINDS.items():
        expression = workload_condition(plural)["expression"]
        no_pod_specs = edit(kind_body(kind, "w", gpu=False),
                            lambda o, k=kind: [t.pop("spec") for t in templates_of(k, o)])
        for obj in ({"metadata": {}}, {"metadata": {"name": "w"}, "spec": {}}, no_pod_specs):
            assert not sent(expression, review(kind, "CREATE", obj))
    assert not sent(POD_CONDITION["expression"], review("Pod", "CREATE", {"metadata": {}, "spec": {}}))
