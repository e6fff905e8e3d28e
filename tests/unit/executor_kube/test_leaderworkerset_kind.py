"""LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), issue 48: its groups become two pod sets (leader: one pod per group,
worker: size-1 per group), it is held at zero groups with the groups to run in `gpuq.io/groups`, started with them
back, and the webhook holds one created running and records how many groups it asked for."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch

from services.core.kube.admission import Review, WebhookPolicy, mutate, response, supported_resources, validate
from services.core.kube.intake import Refusal, job_spec
from services.core.kube.kinds import kind_of
from shared.config import KubernetesSource, QueuesConfig
from tests.unit.executor_kube.conftest import pod_template

LWS = kind_of("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")


def lws(replicas: int = 0, groups: int | None = 3, size: int = 4, leader: bool = True) -> dict[str, Any]:
    lwt: dict[str, Any] = {"size": size, "workerTemplate": pod_template(8)}
    if leader:
        lwt["leaderTemplate"] = pod_template(0)
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": "serve", "namespace": "ml-a", "uid": "lws-uid", "labels": {"gpuq.io/queue": "team-a"},
                         "annotations": {} if groups is None else {"gpuq.io/groups": str(groups)}},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": lwt}}


def test_groups_become_a_leader_and_a_worker_pod_set(queues: QueuesConfig, kube_cfg: KubernetesSource) -> None:
    assert LWS is not None and ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets") in supported_resources()
    spec = job_spec(LWS, lws(), queues, kube_cfg)
    assert not isinstance(spec, Refusal)
    assert [(p.name, p.count, p.gpus_per_pod) for p in spec.pod_sets] == [("leader", 3, 0), ("worker", 9, 8)]
    no_leader = LWS.pod_sets(lws(leader=False))  # the leader runs the workers' template
    assert no_leader[0].template == no_leader[1].template
    assert [p.name for p in LWS.pod_sets(lws(size=1))] == ["leader"]


def test_held_at_zero_groups_and_started_with_them_back() -> None:
    assert LWS is not None
    held = lws()
    assert LWS.suspended(held) and LWS.stopped(held) and LWS.finished(held) is None
    assert not LWS.stopped({**held, "status": {"replicas": 1}})  # its controller has groups left
    patch = LWS.run_patch(held, {"worker": {"spec": {"x": 1}}})
    assert patch["spec"]["replicas"] == 3 and patch["spec"]["leaderWorkerTemplate"]["workerTemplate"] == {
        "spec": {"x": 1}}
    assert LWS.run_patch(lws(replicas=3), {}, suspend=True)["spec"]["replicas"] == 0
    assert not LWS.suspended(lws(replicas=3))


def test_the_webhook_holds_one_created_running_and_refuses_a_users_scale_up(queues: QueuesConfig) -> None:
    obj = lws(replicas=2, groups=None)
    del obj["metadata"]["annotations"]
    review = Review(uid="u", operation="CREATE", group="leaderworkerset.x-k8s.io", version="v1",
                    kind="LeaderWorkerSet", namespace="ml-a", user="alice", obj=obj, old=None)
    policy = WebhookPolicy(queues=queues)
    answer = response("u", mutate(review, policy))["response"]
    after = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(answer["patch"])))
    assert after["spec"]["replicas"] == 0
    assert after["metadata"]["annotations"] == {"gpuq.io/groups": "2", "gpuq.io/user": "alice"}
    assert validate(Review(uid="u", operation="CREATE", group="leaderworkerset.x-k8s.io", version="v1",
                           kind="LeaderWorkerSet", namespace="ml-a", user="alice", obj=after, old=None),
                    policy).allowed
    scaled = json.loads(json.dumps(after))
    scaled["spec"]["replicas"] = 2
    refused = validate(Review(uid="u", operation="UPDATE", group="leaderworkerset.x-k8s.io", version="v1",
                              kind="LeaderWorkerSet", namespace="ml-a", user="alice", obj=scaled, old=after), policy)
    assert not refused.allowed and "only gpuq resumes" in refused.message
