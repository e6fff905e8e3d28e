"""The chart's `rbac.autoscaler`: off by default (no role names the autoscaler's objects); on, the executor may create
and delete ProvisioningRequests and PodTemplates only where it changes workloads, read the autoscaler's answers
cluster-wide, and patch nodes (scale-down marks) through a role of its own, so that its main cluster role stays
read-only."""

from __future__ import annotations

from typing import Any

from tests.deploy.test_chart import CI_VALUES, granted_by, of_kind


def test_rbac_autoscaler_is_off_by_default_and_grants_exactly_what_capacity_needs(render: Any) -> None:
    plain = of_kind(render(CI_VALUES), "ClusterRole")
    assert "gpuq-executor-autoscaler" not in plain
    assert not any(k[0] == "autoscaling.x-k8s.io" or k[1] == "podtemplates"
                   for name, role in plain.items() if name != "gpuq-webhook" for k in granted_by(role))
    docs = render(CI_VALUES, sets=["rbac.autoscaler=true"])
    roles = of_kind(docs, "ClusterRole")
    assert granted_by(roles["gpuq-executor-autoscaler"]) == {
        ("autoscaling.x-k8s.io", "provisioningrequests"): {"list", "watch"}, ("", "nodes"): {"patch"}}
    workloads = granted_by(roles["gpuq-executor-workloads"])
    assert workloads[("autoscaling.x-k8s.io", "provisioningrequests")] == {"create", "delete"}
    assert workloads[("", "podtemplates")] == {"create", "delete"}
    assert granted_by(roles["gpuq-executor"]) == granted_by(plain["gpuq-executor"])
    (binding,) = [b for b in of_kind(docs, "ClusterRoleBinding").values()
                  if b["roleRef"]["name"] == "gpuq-executor-autoscaler"]
    assert [s["kind"] for s in binding["subjects"]] == ["ServiceAccount"]
