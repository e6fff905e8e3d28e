"""Plain pods (issue 48 item 1, Kueue's plain-pod integration): a Pod labelled `gpuq.io/queue` that no controller owns
is a job of one pod set `main` of one pod; pods sharing `gpuq.io/pod-group` are one gang once all
`gpuq.io/pod-group-total-count` of them exist. The webhook holds such a pod by gpuq's gate and stamps its user; it
refuses a queue the namespace may not use, gpuq's keys written by a user, and the gate removed by one; a GPU pod
without the queue label is refused as before."""

from __future__ import annotations

import copy
from typing import Any

from services.core.kube.admission import Review, WebhookPolicy, mutate, validate
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import all_kinds
from services.core.kube.kinds import pod as kpod
from shared.config import KubernetesSource, QueuesConfig
from tests.unit.executor_kube.conftest import container

USER = "system:serviceaccount:ml-a:alice"
GATE = {"name": "gpuq.io/placement"}


def pod(name: str = "p", namespace: str = "ml-a", *, gpus: int = 2, queue: str | None = "team-a",
        group: str | None = None, total: str | None = None, gated: bool = True, owner: bool = False,
        uid: str | None = None) -> dict[str, Any]:
    labels = {"app": "x"}
    annotations: dict[str, str] = {}
    if queue is not None:
        labels["gpuq.io/queue"] = queue
    if group is not None:
        labels["gpuq.io/pod-group"] = group
    if total is not None:
        annotations["gpuq.io/pod-group-total-count"] = total
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}", "labels": labels,
                            "annotations": annotations, "creationTimestamp": f"2026-12-06T10:00:0{len(name) % 10}Z"}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "r",
                                    "controller": True}]
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container(gpus, cpu="4", memory="8Gi")]}
    if gated:
        spec["schedulingGates"] = [GATE]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def test_a_labelled_pod_no_controller_owns_is_a_job_of_one_pod(queues: QueuesConfig,
                                                                kube_cfg: KubernetesSource) -> None:
    assert kpod.plain(pod()) and not kpod.plain(pod(owner=True)) and not kpod.plain(pod(queue=None))
    assert kpod.PLAIN_POD not in all_kinds()  # no workload informer or webhook rule of the other kinds
    spec = job_spec(kpod.PLAIN_POD, pod(), queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod, p.cpu_milli, p.memory_mib) for p in spec.pod_sets] == [
        ("main", 1, 2, 4000, 8192)]
    assert spec.job_id == "ml-a.p.uidp" and spec.team == "team-a" and spec.queue == "team-a"
    assert spec.workload is not None and (spec.workload.kind, spec.workload.name) == ("Pod", "p")
    assert kpod.PLAIN_POD.suspended(pod()) and not kpod.PLAIN_POD.suspended(pod(gated=False))
    # another team's queue, from this namespace: refused at intake
    refused = job_spec(kpod.PLAIN_POD, pod(queue="team-b"), queues, kube_cfg)
    assert isinstance(refused, Refusal) and refused.reason == "QueueNotAllowed"


def test_a_pod_ends_with_its_phase() -> None:
    running = pod()
    assert kpod.PLAIN_POD.finished(running) is None
    done = {**running, "status": {"phase": "Succeeded"}}
    failed = {**running, "status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"}}
    assert kpod.PLAIN_POD.finished(done) == kpod.Finish(True, "Succeeded")
    end = kpod.PLAIN_POD.finished(failed)
    assert end is not None and not end.succeeded and end.reason == "Evicted" and "low memory" in end.message
    assert kpod.start_patch("j", "main", None) == {"metadata": {
        "labels": {"gpuq.io/job": kpod.n.job_label("j"), "gpuq.io/pod-set": "main"},
        "annotations": {"gpuq.io/job-id": "j", "gpuq.io/resume-from": None}}}


def test_a_group_is_taken_in_once_all_its_pods_exist(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    a, b = pod("w-0", group="g", total="2"), pod("w-1", group="g", total="2")
    assert kpod.group_object("g", [a]) == kpod.GroupState(waiting=1)
    state = kpod.group_object("g", [b, a])
    assert state.obj is not None and state.obj["metadata"]["name"] == "g"
    assert state.obj["metadata"]["uid"] == "uid-w-0"  # the first pod's, by name
    spec = job_spec(kpod.POD_GROUP, state.obj, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("main", 2, 2)]
    assert spec.gang_size == 2 and spec.workload is not None and spec.workload.kind == "PodGroup"
    # pods of two shapes: two pod sets, in the order of each shape's first pod
    head = pod("a-head", group="g", total="3", gpus=0)
    mixed = kpod.group_object("g", [head, *(pod(f"w-{i}", group="g", total="3") for i in range(2))]).obj
    assert mixed is not None
    assert kpod.pod_set_names(mixed["pods"]) == {"a-head": "role-0", "w-0": "role-1", "w-1": "role-1"}
    spec = job_spec(kpod.POD_GROUP, mixed, queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("role-0", 1, 0), ("role-1", 2, 2)]
    # never taken in as it is: more pods than said, pods that disagree, a size that is not a number
    assert "more than" in str(kpod.group_object("g", [a, b, pod("w-2", group="g", total="2")]).problem)
    assert "disagree" in str(kpod.group_object("g", [a, pod("w-1", group="g", total="3")]).problem)
    assert "not a whole number" in str(kpod.group_object("g", [pod("w", group="g", total="two")]).problem)
    assert "no annotation" in str(kpod.group_object("g", [pod("w", group="g")]).problem)


def test_a_group_fails_with_its_first_failed_pod_and_succeeds_with_all() -> None:
    a, b = pod("w-0", group="g", total="2"), pod("w-1", group="g", total="2")
    done = [{**p, "status": {"phase": "Succeeded"}} for p in (a, b)]
    assert kpod.POD_GROUP.finished({"pods": [done[0], b]}) is None
    assert kpod.POD_GROUP.finished({"pods": done}) == kpod.Finish(True, "Succeeded")
    end = kpod.POD_GROUP.finished({"pods": [done[0], {**b, "status": {"phase": "Failed"}}]})
    assert end is not None and not end.succeeded


def review(operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None, user: str = USER,
           namespace: str = "ml-a") -> Review:
    return Review(uid="u", operation=operation, group="", version="v1", kind="Pod", namespace=namespace, user=user,
                  obj=obj, old=old)


def test_the_webhook_holds_a_labelled_pod_and_stamps_its_user(queues: QueuesConfig) -> None:
    policy = WebhookPolicy(queues=queues, trusted_users=frozenset({"system:serviceaccount:gpuq:executor"}))
    answer = mutate(review("CREATE", pod(gated=False)), policy)
    assert answer.allowed and answer.patch == [
        {"op": "add", "path": "/spec/schedulingGates", "value": [GATE]},
        {"op": "add", "path": "/metadata/annotations/gpuq.io~1user", "value": USER}]
    own_gate = pod(gated=False)
    own_gate["spec"]["schedulingGates"] = [{"name": "mine"}]
    assert mutate(review("CREATE", own_gate), policy).patch[0] == {
        "op": "replace", "path": "/spec/schedulingGates", "value": [{"name": "mine"}, GATE]}
    # left alone: a pod a controller owns, an unlabelled one, an unmanaged namespace, gpuq itself
    for r in (review("CREATE", pod(gated=False, owner=True)), review("CREATE", pod(gated=False, queue=None)),
              review("CREATE", pod(gated=False), namespace="elsewhere"),
              review("CREATE", pod(gated=False), user="system:serviceaccount:gpuq:executor")):
        assert mutate(r, policy).patch == []
    # an unlabelled GPU pod is still refused (as before), a labelled one held by the gate allowed
    assert not validate(review("CREATE", pod(gated=False, queue=None)), policy).allowed
    created = copy.deepcopy(pod())
    created["metadata"]["annotations"]["gpuq.io/user"] = USER
    assert validate(review("CREATE", created), policy).allowed


def test_the_webhook_refuses_what_a_plain_pod_may_not_do(queues: QueuesConfig) -> None:
    policy = WebhookPolicy(queues=queues)
    refused = validate(review("CREATE", pod(queue="team-b")), policy)
    assert not refused.allowed and "queue 'team-b' is not open to namespace ml-a" in refused.message
    assert not validate(review("CREATE", pod(gated=False)), policy).allowed  # the gate is gpuq's hold
    claimed = pod()
    claimed["metadata"]["labels"]["gpuq.io/job"] = "0123"
    assert "gpuq.io/job" in validate(review("CREATE", claimed), policy).message
    someone = pod()
    someone["metadata"]["annotations"]["gpuq.io/user"] = "bob"
    assert not validate(review("CREATE", someone), policy).allowed
    running = pod()
    running["metadata"]["labels"].update({"gpuq.io/job": "0123", "gpuq.io/pod-set": "main"})
    ungated = copy.deepcopy(running)
    ungated["spec"]["schedulingGates"] = []
    assert "only gpuq removes" in validate(review("UPDATE", ungated, running), policy).message
    relabelled = copy.deepcopy(running)
    relabelled["metadata"]["labels"]["gpuq.io/job"] = "4567"
    assert not validate(review("UPDATE", relabelled, running), policy).allowed
    # the SDK's checkpoint report, and a CPU pod in its own queue and group, are the user's to write
    reported = copy.deepcopy(running)
    reported["metadata"]["annotations"]["gpuq.io/last-checkpoint"] = "s3://c/1"
    assert validate(review("UPDATE", reported, running), policy).allowed
    assert validate(review("CREATE", pod(gpus=0, group="g", total="2")), policy).allowed


def test_the_pod_mutation_is_sent_every_pod_it_holds_and_no_other(queues: QueuesConfig) -> None:
    """The chart's matchCondition for the pods' mutating webhook (tests/kube_support.py holds the same text),
    evaluated by a real CEL implementation: sent what `mutate` patches, not a pod a controller owns or one without the
    queue label (which then never waits for gpuq while it is down)."""
    from tests.kube.kubefake import cel
    from tests.kube_support import POD_MUTATE_CONDITION

    policy = WebhookPolicy(queues=queues)

    def sent(obj: dict[str, Any]) -> bool:
        request = {"operation": "CREATE", "namespace": "ml-a", "userInfo": {"username": USER},
                   "kind": {"group": "", "version": "v1", "kind": "Pod"}}
        return bool(cel.evaluate(POD_MUTATE_CONDITION["expression"], obj, None, request))

    for obj in (pod(gated=False), pod(gated=False, gpus=0), pod(gated=False, group="g", total="2")):
        assert mutate(review("CREATE", obj), policy).patch and sent(obj)
    for obj in (pod(gated=False, owner=True), pod(gated=False, queue=None), {"metadata": {}, "spec": {}}):
        assert not mutate(review("CREATE", obj), policy).patch and not sent(obj)
    not_controller = pod(gated=False)
    not_controller["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c",
                                                      "uid": "c"}]
    assert sent(not_controller) and mutate(review("CREATE", not_controller), policy).patch
