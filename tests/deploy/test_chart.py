"""What the chart renders with the CI values: least-privilege RBAC, hardened pods with probes on the health endpoints,
standbys for the singletons, PDBs, config that rolls the pods, secrets by reference, and the observability objects
taken from the one copy of the rules and dashboards under deploy/."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.config import parse_cluster, parse_queues

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuq"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
SIM_VALUES = CHART / "ci" / "sim-values.yaml"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
DASHBOARDS_DIR = ROOT / "deploy" / "grafana" / "dashboards"
SERVICES = ("admission", "executor", "metering", "preemption", "scheduler", "telemetry")
SINGLETONS = ("admission", "preemption", "scheduler")
CI_DIGEST = "4f5c2d8a7b1e9f3c6d0a2b4e8f1c3d5a7b9e0f2c4d6a8b0e1f3c5d7a9b2e4f6c"

Doc = dict[str, Any]

# The issue's list, exactly: anything wider (a verb, a resource, a wildcard) fails.
EXECUTOR_RULES = {
    ("", "nodes"): {"list", "watch"},
    ("", "pods"): {"get", "list", "watch", "patch", "delete"},
    ("", "events"): {"create"},
    ("batch", "jobs"): {"get", "list", "watch", "patch", "update", "create"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "list", "watch", "patch", "update", "create"},
    ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "patch", "update"},
    ("ray.io", "rayjobs"): {"get", "list", "watch", "patch", "update"},
}


def of_kind(docs: Sequence[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def deployments(docs: Sequence[Doc]) -> dict[str, Doc]:
    """Deployments by service (their component label)."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "Deployment"}


def container(deployment: Doc) -> Doc:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    out: Doc = only
    return out


def env_of(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.fixture(scope="module")
def docs(render: Any) -> list[Doc]:
    out: list[Doc] = render(CI_VALUES)
    return out


def test_rbac_grants_the_executor_exactly_its_verbs_and_nothing_wider(docs: list[Doc]) -> None:
    roles = of_kind(docs, "ClusterRole")
    assert list(roles) == ["gpuq-executor"] and not of_kind(docs, "Role")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in roles["gpuq-executor"]["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/nonResourceURLs tricks
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == EXECUTOR_RULES

    (binding,) = of_kind(docs, "ClusterRoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "gpuq-executor"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuq-executor", "namespace": "gpuq-system"}]
    # Only the executor's pods carry that identity and a token; the others have no token at all.
    for service, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        if service == "executor":
            assert pod["serviceAccountName"] == "gpuq-executor" and pod["automountServiceAccountToken"] is True
        else:
            assert pod["serviceAccountName"] == "gpuq" and pod["automountServiceAccountToken"] is False


def test_every_pod_is_non_root_read_only_without_capabilities_and_sized(docs: list[Doc]) -> None:
    assert set(deployments(docs)) == set(SERVICES)
    for service, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        c = container(deployment)
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, service
        assert sc["capabilities"] == {"drop": ["ALL"]}, service
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], service
        assert c["resources"]["limits"]["memory"], service
        # The writable places a read-only root needs: /tmp only.
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/etc/gpuq"]["readOnly"] is True and set(mounts) == {"/etc/gpuq", "/tmp"}
        assert c["image"] == f"registry.example.com/platform/gpuq@sha256:{CI_DIGEST}"  # pulled by digest


def test_probes_use_the_health_endpoints_of_gpuq_up(docs: list[Doc]) -> None:
    for service, deployment in deployments(docs).items():
        c = container(deployment)
        assert c["args"][:2] == ["up", f"--services={service}"]
        assert "--health-port=8080" in c["args"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["health"] == 8080
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        # The readiness checks wait 2 s each at most (shared/health.py): the probe must wait longer.
        assert c["readinessProbe"]["timeoutSeconds"] >= 4
        assert ("--metrics-port=9464" in c["args"]) == (service == "telemetry")
    executor = container(deployments(docs)["executor"])
    assert "--executor=kube" in executor["args"]


def test_singletons_run_a_hot_standby_and_pdbs_keep_one_pod(docs: list[Doc]) -> None:
    pdbs = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p
            for p in of_kind(docs, "PodDisruptionBudget").values()}
    assert set(pdbs) == set(SERVICES)
    for service, deployment in deployments(docs).items():
        spec = deployment["spec"]
        assert spec["replicas"] == (2 if service in SINGLETONS else 1), service
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        assert pdbs[service]["spec"]["selector"] == spec["selector"]
        assert pdbs[service]["spec"]["maxUnavailable"] == 1
        spread = spec["template"]["spec"].get("topologySpreadConstraints")
        if service in SINGLETONS:  # the standby does not share the leader's node when another one is free
            assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
            assert spread[0]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
        else:
            assert spread is None


def test_config_comes_from_a_configmap_whose_checksum_rolls_the_pods(render: Any, docs: list[Doc]) -> None:
    config = of_kind(docs, "ConfigMap")["gpuq-config"]
    queues = parse_queues(yaml.safe_load(config["data"]["queues.yaml"]), "rendered queues.yaml")
    assert [q.name for q in queues.queues] == ["vision", "nlp"]  # gpuq's own loader accepts what the chart mounts
    sim = of_kind(render(SIM_VALUES), "ConfigMap")["gpuq-config"]
    assert parse_cluster(yaml.safe_load(sim["data"]["cluster.yaml"]), "rendered cluster.yaml").total_gpus == 32

    def checksums(rendered: list[Doc]) -> set[str]:
        return {d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
                for d in deployments(rendered).values()}

    before = checksums(docs)
    assert len(before) == 1  # every service carries the same config's checksum
    assert checksums(render(CI_VALUES)) == before  # deterministic: an unchanged config rolls nothing
    changed = render(CI_VALUES, sets=["config.queues.policy.protection_window_s=900"])
    assert checksums(changed).isdisjoint(before)  # a quota or policy change rolls every pod
    for deployment in deployments(docs).values():
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == "gpuq-config"
        assert "--queues=/etc/gpuq/queues.yaml" in container(deployment)["args"]


def test_secrets_are_only_referenced(render: Any, docs: list[Doc]) -> None:
    for rendered in (docs, render(SIM_VALUES)):
        assert not of_kind(rendered, "Secret")
        for deployment in deployments(rendered).values():
            env = env_of(container(deployment))
            assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gpuq-database", "key": "uri"}
            assert env["GPUQ_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    ci_env = env_of(container(deployments(docs)["scheduler"]))
    assert ci_env["NATS_URL"] == {"name": "NATS_URL", "value": "nats://nats.messaging.svc:4222"}
    sim_env = env_of(container(deployments(render(SIM_VALUES))["scheduler"]))
    assert sim_env["NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gpuq-nats", "key": "url"}


def test_prometheus_rule_is_the_rules_directory(docs: list[Doc]) -> None:
    (rule,) = of_kind(docs, "PrometheusRule").values()
    expected: list[Any] = []
    for path in sorted([*RULES_DIR.glob("*.yml"), *RULES_DIR.glob("*.yaml")]):
        expected += yaml.safe_load(path.read_text())["groups"]
    assert expected and rule["spec"]["groups"] == expected
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The chart holds no copy: its files/ entry is a link to that directory.
    link = CHART / "files" / "prometheus-rules"
    assert link.is_symlink() and link.resolve() == RULES_DIR.resolve()


def test_dashboards_are_configmaps_for_the_grafana_sidecar(docs: list[Doc]) -> None:
    maps = {name: cm for name, cm in of_kind(docs, "ConfigMap").items() if name.startswith("gpuq-dashboard-")}
    files = sorted(DASHBOARDS_DIR.glob("*.json"))
    assert len(maps) == len(files) == 3
    by_file = {key: (cm, value) for cm in maps.values() for key, value in cm["data"].items()}
    for path in files:
        cm, body = by_file[path.name]
        assert json.loads(body) == json.loads(path.read_text())
        assert hashlib.sha256(body.encode()).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "gpuq"
        assert cm["metadata"]["namespace"] == "monitoring"
    link = CHART / "files" / "dashboards"
    assert link.is_symlink() and link.resolve() == DASHBOARDS_DIR.resolve()


def test_servicemonitor_scrapes_telemetrys_metrics_port(docs: list[Doc]) -> None:
    (monitor,) = of_kind(docs, "ServiceMonitor").values()
    service = of_kind(docs, "Service")["gpuq-telemetry"]
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["gpuq-system"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] == "metrics" and endpoint["path"] == "/metrics"
    telemetry = deployments(docs)["telemetry"]
    assert service["spec"]["selector"] == telemetry["spec"]["selector"]["matchLabels"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container(telemetry)["ports"]


def test_network_policies_allow_only_what_the_services_use(docs: list[Doc]) -> None:
    policies = of_kind(docs, "NetworkPolicy")
    base = policies["gpuq"]
    assert base["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert base["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]
    egress_ports = [sorted((p["port"], p["protocol"]) for p in rule["ports"]) for rule in base["spec"]["egress"]]
    assert egress_ports == [[(53, "TCP"), (53, "UDP")], [(4222, "TCP")], [(5432, "TCP")]]
    assert base["spec"]["egress"][2]["to"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    telemetry = policies["gpuq-telemetry"]["spec"]
    assert telemetry["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    executor = policies["gpuq-executor"]["spec"]
    assert executor["egress"] == [{"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}]


def test_simulated_executor_gets_no_kubernetes_permissions(render: Any) -> None:
    docs = render(SIM_VALUES)
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    assert list(of_kind(docs, "ServiceAccount")) == ["gpuq"]
    executor = deployments(docs)["executor"]
    assert "--executor=sim" in container(executor)["args"]
    assert executor["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "metering" not in deployments(docs)  # a disabled service renders nothing
    assert not of_kind(docs, "NetworkPolicy") and not of_kind(docs, "ServiceMonitor")


def test_optional_subcharts_are_off_by_default_and_wired_when_on(render: Any) -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    deps = {d.get("alias", d["name"]): d for d in meta["dependencies"]}
    assert {k: (d["name"], d["condition"]) for k, d in deps.items()} == {
        "nats": ("nats", "nats.enabled"), "cnpg": ("cluster", "cnpg.enabled")}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["nats"]["enabled"] is False and values["cnpg"]["enabled"] is False
    assert values["nats"]["config"]["jetstream"]["enabled"] is True
    assert values["nats"]["config"]["cluster"]["replicas"] == 3
    # With both on, the services reach the subcharts' own service and secret (the subcharts themselves need
    # `helm dependency build`, so they are not rendered here).
    docs = render(CI_VALUES, sets=["nats.enabled=true", "cnpg.enabled=true"])
    env = env_of(container(deployments(docs)["admission"]))
    assert env["NATS_URL"]["value"] == "nats://gpuq-nats:4222"
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gpuq-cnpg-app", "key": "uri"}
