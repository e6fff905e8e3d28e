"""The pure decisions behind ProvisioningRequests and scale-down (services/core/kube/provisioning.py)."""

from __future__ import annotations

import pytest

from services.core.kube import provisioning as prov
from shared.config import Provisioning, ProvisioningClass, parse_queues
from shared.domain import JobSpec, PodSet


def spec(models: tuple[str, ...] = ()) -> JobSpec:
    return JobSpec(job_id="j1", team="a", queue="qa", pod_sets=(PodSet(name="Worker", count=4, gpus_per_pod=8,
                                                                       gpu_models=models),))


def test_only_a_job_first_in_line_for_nodes_asks() -> None:
    assert prov.waits_for_capacity("admission", "WaitingForCapacity", 1)
    assert not prov.waits_for_capacity("admission", "WaitingForCapacity", 2)  # not the head of its queue
    assert not prov.waits_for_capacity("admission", "WaitingForQuota", 1)  # more nodes would not help
    assert prov.waits_for_capacity("placement", "InsufficientGpus", None)  # admitted: ahead of all queued
    assert not prov.waits_for_capacity("placement", "PlacementRefused", None)


def test_opt_in_is_per_queue_and_flavor() -> None:
    assert not prov.opted_in(None, spec())
    assert prov.opted_in(Provisioning(), spec(("H100",)))
    assert prov.opted_in(Provisioning(flavors=("H100",)), spec(("A100", "H100")))
    assert not prov.opted_in(Provisioning(flavors=("H100",)), spec(("A100",)))


def test_the_request_names_a_pod_template_per_pod_set_with_the_whole_gang() -> None:
    objects = prov.request_objects(
        name=prov.request_name("Train_Big", 2), namespace="ns", job_id="j1", spec=spec(),
        owner={"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "Train_Big", "uid": "u1"},
        templates={"Worker": {"spec": {"containers": [{"name": "c"}]}}},
        provisioning=Provisioning(class_name=ProvisioningClass.CHECK_CAPACITY, parameters={"noRetry": "true"}))
    request = objects.request
    assert request["metadata"]["name"] == "train-big-gpuq-2"
    assert request["spec"] == {"provisioningClassName": "check-capacity.autoscaling.x-k8s.io",
                               "podSets": [{"podTemplateRef": {"name": "ppt-train-big-gpuq-2-worker"}, "count": 4}],
                               "parameters": {"noRetry": "true"}}
    (template,) = objects.templates
    assert template["metadata"]["name"] == "ppt-train-big-gpuq-2-worker"
    assert template["template"] == {"spec": {"containers": [{"name": "c"}]}}
    assert request["metadata"]["ownerReferences"][0]["uid"] == "u1"


def test_the_autoscalers_answer() -> None:
    def obj(*conds: tuple[str, str, str]) -> dict[str, object]:
        return {"status": {"conditions": [{"type": t, "status": s, "reason": r, "message": "m",
                                           "lastTransitionTime": f"2026-01-01T00:00:0{i}Z"}
                                          for i, (t, s, r) in enumerate(conds)]}}

    assert prov.verdict({}).state == "requested"
    assert prov.verdict(obj(("Accepted", "True", "Accepted"), ("Provisioned", "False", "CapacityIsNotFound"))) \
        == prov.Verdict("requested", "CapacityIsNotFound", "m")
    assert prov.verdict(obj(("Provisioned", "True", "CapacityIsProvisioned"))).state == "provisioned"
    assert prov.verdict(obj(("Provisioned", "True", "CapacityIsProvisioned"), ("BookingExpired", "True", "x"))) \
        .state == "provisioned"  # a job placed meanwhile keeps its nodes
    assert prov.verdict(obj(("Provisioned", "True", "CapacityIsFound"), ("CapacityRevoked", "True", "Gone"))) \
        == prov.Verdict("failed", "Gone", "m")
    assert prov.verdict(obj(("Failed", "True", "CapacityIsNotFound"))) == prov.Verdict("failed",
                                                                                      "CapacityIsNotFound", "m")


def test_retries_back_off_and_end() -> None:
    p = Provisioning(retry_limit=2, backoff_s=60)
    assert prov.retry_at(1000.0, 2, p) == 1060.0  # the second request, after the first failed
    assert prov.retry_at(1000.0, 3, p) == 1120.0
    assert prov.retry_at(1000.0, 4, p) is None  # 1 + 2 retries spent
    assert prov.retry_at(0.0, 2, Provisioning(backoff_s=10_000)) == prov.MAX_BACKOFF_S


def node(name: str, **annotations: str) -> dict[str, object]:
    return {"metadata": {"name": name, "annotations": annotations}}


def test_scale_down_releases_only_after_the_cool_down() -> None:
    nodes = [node("busy"), node("cooling"), node("idle", **{prov.SCALE_DOWN_DISABLED: "true", prov.HELD: "true"})]
    marks, since = prov.scale_down_marks(nodes, ["busy"], {"cooling": 950.0, "idle": 100.0}, 1000.0, 300.0)
    by_node = {m.node: m.annotations for m in marks}
    assert by_node["busy"] == {prov.SCALE_DOWN_DISABLED: "true", prov.HELD: "true"}
    assert by_node["cooling"] == {prov.SCALE_DOWN_DISABLED: "true", prov.HELD: "true"}
    assert by_node["idle"] == {prov.SCALE_DOWN_DISABLED: None, prov.HELD: None,
                               prov.IDLE_SINCE: "1970-01-01T00:01:40Z"}
    assert since == {"cooling": 950.0, "idle": 100.0}


def test_scale_down_counts_the_cool_down_from_first_sight_and_leaves_an_admins_annotation() -> None:
    marks, since = prov.scale_down_marks([node("new")], [], {}, 1000.0, 300.0)
    assert [m.annotations for m in marks] == [{prov.SCALE_DOWN_DISABLED: "true", prov.HELD: "true"}]
    assert since == {"new": 1000.0}
    admins = node("pinned", **{prov.SCALE_DOWN_DISABLED: "true"})
    marks, _ = prov.scale_down_marks([admins], [], {"pinned": 0.0}, 1000.0, 300.0)
    assert [m.annotations for m in marks] == [{prov.IDLE_SINCE: "1970-01-01T00:00:00Z"}]  # its own flag stays
    marks, _ = prov.scale_down_marks([admins], ["pinned"], {}, 1000.0, 300.0)
    assert marks == []


def test_provisioning_is_off_by_default_and_checked() -> None:
    base = {"priority_classes": [{"name": "p", "value": 1}]}
    config = parse_queues({**base, "queues": [{"name": "qa", "quotas": {"H100": {"nominal": 8}}}]})
    assert config.queues[0].provisioning is None
    with pytest.raises(ValueError, match=r"provisioning.flavors A100 not in its quotas"):
        parse_queues({**base, "queues": [{"name": "qa", "quotas": {"H100": {"nominal": 8}},
                                          "provisioning": {"flavors": ["A100"]}}]})


def test_explain_says_where_the_request_stands() -> None:
    row = {"namespace": "ml", "name": "big-gpuq-1", "class_name": "check-capacity.autoscaling.x-k8s.io",
           "state": "requested", "reason": "CapacityIsNotFound",
           "message": "Capacity is not found, CA will try to find it later.", "retry_at": None}
    assert prov.words(row) == ("capacity asked of the autoscaler: ProvisioningRequest ml/big-gpuq-1 (check-capacity) "
                               "waiting for the autoscaler: CapacityIsNotFound: Capacity is not found, CA will try to "
                               "find it later.")
    assert prov.words({**row, "state": "provisioned", "reason": "CapacityIsFound", "message": ""}).endswith(
        "(check-capacity) provisioned: CapacityIsFound")
    assert prov.words({**row, "state": "failed", "retry_at": 5.0}).endswith(
        "failed: CapacityIsNotFound: Capacity is not found, CA will try to find it later.; gpuq stopped waiting for "
        "it, asked again later")
