"""The fake API server's admission webhooks' CEL `matchConditions`, as kube-apiserver evaluates them: every condition
true calls the webhook, any false one skips it (even beside one that failed to evaluate), an evaluation error
refuses the request under failurePolicy Fail (403, the webhook not called) and skips the webhook under Ignore; the
conditions see `object`, `oldObject` and `request`; a configuration whose expression does not compile is refused.

The probe webhook points at an address where nothing listens, so a request it is called on fails ("failed calling
webhook", 500) and one it is not called on is created: what was sent is what the API server answers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from tests.kube.kubefake.cluster import KubeCluster

VALIDATING = create_global_resource("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration",
                                    "validatingwebhookconfigurations")
NAMESPACE = "mc-probe"
ERROR = "object.metadata.nope == 'x'"  # no such key: an evaluation error


def probe(name: str, conditions: list[str], failure_policy: str = "Fail",
          operations: tuple[str, ...] = ("CREATE",)) -> dict[str, Any]:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name}, "webhooks": [{
                "name": "probe.example.com", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": failure_policy, "timeoutSeconds": 2,
                "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                "matchConditions": [{"name": f"c{i}", "expression": e} for i, e in enumerate(conditions)],
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                           "operations": list(operations), "scope": "Namespaced"}]}]}


def pod(name: str) -> Pod:
    return Pod.from_dict({"metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "probe"}}, "spec": {
        "containers": [{"name": "main", "image": "busybox", "command": ["true"]}]}})


async def with_probe(kube_api: KubeCluster, conditions: list[str], failure_policy: str = "Fail",
                     operations: tuple[str, ...] = ("CREATE",)) -> str:
    await kube_api.create_namespace(NAMESPACE)
    name = f"probe-{uuid.uuid4().hex[:6]}"
    await kube_api.client().create(VALIDATING(probe(name, conditions, failure_policy, operations)))
    return name


async def outcome(kube_api: KubeCluster, name: str) -> int:
    """201 when the pod was created, else the refusal's code."""
    try:
        await kube_api.client().create(pod(name))
    except ApiError as error:
        return int(error.status.code or 0)
    return 201


@pytest.mark.parametrize(("conditions", "failure_policy", "code"), [
    (["true"], "Fail", 500),  # called: the unreachable webhook fails the request
    (["true", "1 == 1"], "Fail", 500),
    (["false"], "Fail", 201),  # not called
    (["true", "false"], "Fail", 201),  # one false is enough
    ([ERROR], "Fail", 403),  # an evaluation error under Fail: refused without calling
    ([ERROR, "true"], "Fail", 403),
    ([ERROR], "Ignore", 201),  # under Ignore: the webhook skipped
    (["false", ERROR], "Fail", 201),  # a false condition skips it even beside an error
    ([ERROR, "false"], "Fail", 201),
])
async def test_every_condition_must_hold_and_errors_follow_the_failure_policy(
        kube_api: KubeCluster, conditions: list[str], failure_policy: str, code: int) -> None:
    config = await with_probe(kube_api, conditions, failure_policy)
    try:
        assert await outcome(kube_api, "p") == code
    finally:
        await kube_api.client().delete(VALIDATING, config)


async def test_conditions_see_the_object_and_the_request(kube_api: KubeCluster) -> None:
    who = await kube_api.username()
    config = await with_probe(kube_api, [
        "object.metadata.name.startsWith('sent-')",
        f"request.userInfo.username == '{who}' && request.namespace == '{NAMESPACE}'",
        "request.resource.resource == 'pods' && request.kind.kind == 'Pod' && request.operation == 'CREATE'",
    ])
    try:
        assert await outcome(kube_api, "sent-a") == 500
        assert await outcome(kube_api, "kept") == 201
    finally:
        await kube_api.client().delete(VALIDATING, config)


async def relabel(kube_api: KubeCluster, name: str, app: str) -> int:
    try:
        await kube_api.client().patch(Pod, name, {"metadata": {"labels": {"app": app}}}, namespace=NAMESPACE,
                                      patch_type=PatchType.MERGE)
    except ApiError as error:
        return int(error.status.code or 0)
    return 200


async def test_on_an_update_old_object_is_the_stored_one(kube_api: KubeCluster) -> None:
    config = await with_probe(kube_api, ["oldObject.metadata.labels['app'] == 'probe'",
                                         "object.metadata.labels['app'] == 'sent'"], operations=("UPDATE",))
    try:
        assert await outcome(kube_api, "a") == 201  # CREATE: not in the rules
        assert await relabel(kube_api, "a", "kept") == 200  # the new object's label is not 'sent'
        assert await relabel(kube_api, "a", "sent") == 200  # the stored one's is no longer 'probe'
        assert await outcome(kube_api, "b") == 201
        assert await relabel(kube_api, "b", "sent") == 500  # both hold: called
    finally:
        await kube_api.client().delete(VALIDATING, config)


async def test_a_condition_that_does_not_compile_refuses_the_configuration(kube_api: KubeCluster) -> None:
    with pytest.raises(ApiError) as refused:
        await kube_api.client().create(VALIDATING(probe(f"probe-{uuid.uuid4().hex[:6]}", ["object.metadata.("])))
    assert refused.value.status.code == 422
