"""The chart's admission webhook (issue 44 item 1): the configurations `helm template` renders pass the Kubernetes
schemas strictly (kubernetes-validate, the oldest and newest versions the chart declares) and are exactly what the
kube tests register on the API server (tests/kube_support.py), pointed at the executor's Service; the executor is
told to serve them, trusting only its own ServiceAccount; its RBAC reaches its certificate's Secret and its two
configurations and nothing else; cert-manager takes over the certificate when asked."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from services.executor.kube.webhook import WebhookSettings
from tests.deploy.test_chart import CI_VALUES, MINIMAL, container, deployments, of_kind
from tests.deploy.test_chart_validation import kubernetes_validate
from tests.kube_support import webhook_configurations

Doc = dict[str, Any]
MANAGED = ["ml-nlp", "ml-vision"]  # ci-values' config.queues.namespaces


def webhook_docs(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")]


def env_of(docs: list[Doc]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(deployments(docs)["executor"])["env"] if "value" in e}


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_the_webhook_configurations_pass_the_kubernetes_schemas(render: Any, tools: Any, version: str,
                                                                tmp_path: Path) -> None:
    docs = webhook_docs(render(CI_VALUES, kube_version=version))
    assert [d["kind"] for d in docs] == ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
    res = kubernetes_validate(tools, docs, version, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    broken = copy.deepcopy(docs)  # the check bites: a value the schema does not allow
    broken[0]["webhooks"][0]["sideEffects"] = "Sometimes"
    broken[0]["webhooks"][0]["unknownField"] = True
    assert kubernetes_validate(tools, broken, version, tmp_path).returncode != 0


def test_the_configurations_are_the_ones_the_kube_tests_register(render: Any) -> None:
    docs = render(CI_VALUES)
    rendered = {d["kind"]: d for d in webhook_docs(docs)}
    for expected in webhook_configurations("gpuq", "https://unused", MANAGED):
        got = rendered[expected["kind"]]
        assert got["metadata"]["name"] == "gpuq"
        assert len(got["webhooks"]) == len(expected["webhooks"])
        for hook, want in zip(got["webhooks"], expected["webhooks"], strict=True):
            client = hook.pop("clientConfig")
            want = {k: v for k, v in want.items() if k != "clientConfig"}
            assert hook == want  # rules, selectors, failurePolicy Fail, timeoutSeconds, sideEffects
            assert client == {"service": {"namespace": "gpuq-system", "name": "gpuq-webhook", "port": 443,
                                          "path": want_path(expected["kind"])}}
    service = of_kind(docs, "Service")["gpuq-webhook"]
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "executor"
    ports = {p["name"]: p["containerPort"] for p in container(deployments(docs)["executor"])["ports"]}
    assert ports["webhook"] == 9443


def want_path(kind: str) -> str:
    return "/mutate" if kind.startswith("Mutating") else "/validate"


def test_the_executor_serves_it_trusting_only_its_own_service_account(render: Any) -> None:
    docs = render(CI_VALUES)
    settings = WebhookSettings.from_env(env_of(docs))
    assert settings is not None and settings.port == 9443
    assert (settings.service, settings.namespace, settings.secret) == ("gpuq-webhook", "gpuq-system",
                                                                       "gpuq-webhook-tls")
    assert settings.configurations == ("gpuq",) and settings.cert_dir is None
    assert settings.trusted_users == ("system:serviceaccount:gpuq-system:gpuq-executor",)
    assert "gpuq-webhook.gpuq-system.svc" in settings.all_hosts
    # RBAC: its certificate's Secret, by name (create cannot be narrowed), and its two configurations, by name.
    role = of_kind(docs, "Role")["gpuq-webhook"]
    assert role["metadata"]["namespace"] == "gpuq-system"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["gpuq-webhook-tls"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    assert of_kind(docs, "ClusterRole")["gpuq-webhook"]["rules"] == [
        {"apiGroups": ["admissionregistration.k8s.io"],
         "resources": ["mutatingwebhookconfigurations", "validatingwebhookconfigurations"],
         "resourceNames": ["gpuq"], "verbs": ["get", "patch"]}]
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        binding = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == "gpuq-webhook")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuq-executor",
                                        "namespace": "gpuq-system"}]
    policy = of_kind(docs, "NetworkPolicy")["gpuq-webhook"]["spec"]
    assert policy["ingress"] == [{"ports": [{"port": "webhook", "protocol": "TCP"}]}]


def test_cert_manager_issues_the_certificate_and_injects_the_ca_when_asked(render: Any) -> None:
    docs = render(CI_VALUES, sets=["webhook.certManager.enabled=true"])
    for doc in webhook_docs(docs):
        assert doc["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "gpuq-system/gpuq-webhook"}
    certificate = next(d for d in docs if d["kind"] == "Certificate")
    assert certificate["spec"]["secretName"] == "gpuq-webhook-tls"
    assert "gpuq-webhook.gpuq-system.svc" in certificate["spec"]["dnsNames"]
    assert certificate["spec"]["issuerRef"] == {"name": "gpuq-webhook", "kind": "Issuer"}
    settings = WebhookSettings.from_env(env_of(docs))
    assert settings is not None and settings.cert_dir == Path("/etc/gpuq-webhook") and settings.configurations == ()
    mounts = {m["name"]: m for m in container(deployments(docs)["executor"])["volumeMounts"]}
    assert mounts["webhook-tls"]["mountPath"] == "/etc/gpuq-webhook"
    assert "gpuq-webhook" not in of_kind(docs, "Role") and "gpuq-webhook" not in of_kind(docs, "ClusterRole")
    issued = render(CI_VALUES, sets=["webhook.certManager.enabled=true", "webhook.certManager.issuerRef.name=ca",
                                     "webhook.certManager.issuerRef.kind=ClusterIssuer"])
    assert not [d for d in issued if d["kind"] == "Issuer"]
    assert next(d for d in issued if d["kind"] == "Certificate")["spec"]["issuerRef"] == {"name": "ca",
                                                                                          "kind": "ClusterIssuer"}


def test_no_webhook_without_a_namespace_to_guard_or_when_turned_off(render: Any) -> None:
    for docs in (render(CI_VALUES, sets=["webhook.enabled=false"]), render(sets=MINIMAL)):
        assert not webhook_docs(docs) and "gpuq-webhook" not in of_kind(docs, "Service")
        assert "GPUQ_WEBHOOK_PORT" not in env_of(docs)
