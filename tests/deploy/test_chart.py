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

from shared.config import ClusterSource, parse_cluster, parse_queues
from shared.natsauth import KUBE
from shared.natsauth import SERVICES as BUS_USERS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuq"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
SIM_VALUES = CHART / "ci" / "sim-values.yaml"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
DASHBOARDS_DIR = ROOT / "deploy" / "grafana" / "dashboards"
SERVICES = ("admission", "api", "audit", "executor", "metering", "preemption", "scheduler", "telemetry")
SINGLETONS = ("admission", "executor", "preemption", "scheduler")
REPLICATED = (*SINGLETONS, "api")  # the API is stateless: two replicas serve
SECRETS_KEY_USERS = ("api", "telemetry")  # they keep webhook signing secrets, encrypted at rest
# The least values an install needs (what docs/install.md tells an operator to set), on the chart's defaults.
# NATS needs nothing: natsAuth is on by default, each service's NATS_URL in the Secret named after its bus user.
MINIMAL = ("externalDatabase.existingSecret.name=gpuq-database", "secretsKey.existingSecret.name=gpuq-secrets-key")
# A server without per-service users: natsAuth turned off, one plain URL for all.
SHARED_URL = (*MINIMAL, "natsAuth.enabled=false", "externalNats.url=nats://nats.messaging.svc:4222")
CI_DIGEST = "4f5c2d8a7b1e9f3c6d0a2b4e8f1c3d5a7b9e0f2c4d6a8b0e1f3c5d7a9b2e4f6c"

Doc = dict[str, Any]

# What the executor calls (services/executor/kube/), exactly: anything wider (a verb, a resource, a wildcard) fails,
# and tests/deploy/test_rbac_enforced.py runs the executor against an API server that enforces these roles.
# Cluster-wide it only reads: every node and pod (placement), the workload kinds (the informers).
EXECUTOR_CLUSTER_RULES = {
    ("", "nodes"): {"list", "watch"},
    ("", "pods"): {"list", "watch"},
    ("batch", "jobs"): {"list", "watch"},
    ("jobset.x-k8s.io", "jobsets"): {"list", "watch"},
    ("kubeflow.org", "pytorchjobs"): {"list", "watch"},
    ("kubeflow.org", "tfjobs"): {"list", "watch"},  # issue 48 item 7
    ("kubeflow.org", "mpijobs"): {"list", "watch"},
    ("kubeflow.org", "notebooks"): {"list", "watch"},  # issue 48: Kubeflow Notebooks
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"list", "watch"},  # issue 48
    ("apps", "statefulsets"): {"list", "watch"},
    ("ray.io", "rayjobs"): {"list", "watch"},
    ("resource.k8s.io", "resourceslices"): {"list", "watch"},  # DRA devices (issue 47)
}
# What it changes, only in the namespaces gpuq manages (a RoleBinding in each).
EXECUTOR_NAMESPACED_RULES = {
    ("", "pods"): {"get", "patch", "delete"},
    ("", "events"): {"create"},
    ("batch", "jobs"): {"get", "patch", "create"},
    ("jobset.x-k8s.io", "jobsets"): {"get", "patch", "create"},
    ("kubeflow.org", "pytorchjobs"): {"get", "patch"},
    ("kubeflow.org", "tfjobs"): {"get", "patch"},
    ("kubeflow.org", "mpijobs"): {"get", "patch"},
    ("kubeflow.org", "notebooks"): {"get", "patch"},  # stopped and started by annotation; no status written
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "patch"},  # held at replicas 0; no status written
    ("apps", "statefulsets"): {"get", "patch"},  # the same
    ("ray.io", "rayjobs"): {"get", "patch"},
    # a job gpuq failed or rejected gets the terminal status the kind's controller writes (issue 45 item 7)
    ("jobset.x-k8s.io", "jobsets/status"): {"patch"},
    ("kubeflow.org", "pytorchjobs/status"): {"patch"},
    ("kubeflow.org", "tfjobs/status"): {"patch"},
    ("kubeflow.org", "mpijobs/status"): {"patch"},
    ("ray.io", "rayjobs/status"): {"patch"},
    # DRA: an event-submitted pod set's claim template, and the allocation written into each pod's claim (issue 47)
    ("resource.k8s.io", "resourceclaimtemplates"): {"create"},
    ("resource.k8s.io", "resourceclaims"): {"get"},
    ("resource.k8s.io", "resourceclaims/status"): {"patch"},
}
DRA_RULES = {k: v for k, v in {**EXECUTOR_CLUSTER_RULES, **EXECUTOR_NAMESPACED_RULES}.items()
             if k[0] == "resource.k8s.io"}
DRA_WRITES = {k for k in EXECUTOR_NAMESPACED_RULES if k[0] == "resource.k8s.io"}
EXECUTOR_RULES = {k: EXECUTOR_CLUSTER_RULES.get(k, set()) | EXECUTOR_NAMESPACED_RULES.get(k, set())
                  for k in {*EXECUTOR_CLUSTER_RULES, *EXECUTOR_NAMESPACED_RULES}}
READ_VERBS = {"get", "list", "watch"}
# Issue 12's list, the ceiling: the executor's role stays inside it, except `create` on Jobs and JobSets for jobs
# submitted as events, which `rbac.eventSubmittedJobs=false` takes away.
WORKLOADS = (("batch", "jobs"), ("jobset.x-k8s.io", "jobsets"), ("kubeflow.org", "pytorchjobs"),
             ("kubeflow.org", "tfjobs"), ("kubeflow.org", "mpijobs"), ("kubeflow.org", "notebooks"),
             ("leaderworkerset.x-k8s.io", "leaderworkersets"), ("apps", "statefulsets"), ("ray.io", "rayjobs"))
CEILING = {("", "nodes"): {"list", "watch"}, ("", "pods"): {"get", "list", "watch", "patch", "delete"},
           ("", "events"): {"create"}, **{w: {"get", "list", "watch", "patch", "update"} for w in WORKLOADS}}
API_RULES = {("authentication.k8s.io", "tokenreviews"): {"create"}}
# Beyond it too: `patch` on the status of the custom kinds, where a job gpuq failed reads as failed (issue 45 item 7).
STATUS_RULES = (("jobset.x-k8s.io", "jobsets/status"), ("kubeflow.org", "pytorchjobs/status"),
                ("kubeflow.org", "tfjobs/status"), ("kubeflow.org", "mpijobs/status"), ("ray.io", "rayjobs/status"))


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


def granted_by(role: Doc) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/nonResourceURLs tricks
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_rbac_grants_the_executor_and_the_api_exactly_their_verbs_and_nothing_wider(render: Any,
                                                                                     docs: list[Doc]) -> None:
    # The admission webhook's own (its certificate Secret, its configurations' caBundle): test_chart_webhook.py.
    roles = {name: role for name, role in of_kind(docs, "ClusterRole").items() if name != "gpuq-webhook"}
    assert sorted(roles) == ["gpuq-api", "gpuq-executor", "gpuq-executor-workloads"]
    assert sorted(of_kind(docs, "Role")) == ["gpuq-webhook"]
    assert granted_by(roles["gpuq-executor"]) == EXECUTOR_CLUSTER_RULES
    assert all(verbs <= READ_VERBS for verbs in granted_by(roles["gpuq-executor"]).values())
    workloads = granted_by(roles["gpuq-executor-workloads"])
    assert workloads == EXECUTOR_NAMESPACED_RULES
    # Inside issue 12's list but for `create` on Jobs and JobSets, which the switch takes away.
    executor = {k: EXECUTOR_CLUSTER_RULES.get(k, set()) | workloads.get(k, set())
                for k in {*EXECUTOR_CLUSTER_RULES, *workloads}}
    beyond = {k: v - CEILING.get(k, set()) for k, v in executor.items() if v - CEILING.get(k, set())}
    # ... and `patch` on the status of the three custom kinds (STATUS_RULES), and DRA's objects (DRA_RULES)
    assert beyond == {("batch", "jobs"): {"create"}, ("jobset.x-k8s.io", "jobsets"): {"create"},
                      **{k: {"patch"} for k in STATUS_RULES}, **DRA_RULES}
    narrow_docs = render(CI_VALUES, sets=["rbac.eventSubmittedJobs=false"])
    narrow = granted_by(of_kind(narrow_docs, "ClusterRole")["gpuq-executor-workloads"])
    assert all(verbs <= CEILING[k] for k, verbs in narrow.items() if k not in STATUS_RULES)
    # the claims DRA writes are event-submitted jobs' only: the switch takes them away too
    assert narrow == {k: v - {"create"} if k in WORKLOADS else v for k, v in EXECUTOR_NAMESPACED_RULES.items()
                      if k not in DRA_WRITES}
    assert granted_by(of_kind(narrow_docs, "ClusterRole")["gpuq-executor"]) == EXECUTOR_CLUSTER_RULES
    assert granted_by(roles["gpuq-api"]) == API_RULES

    bindings = {name: b for name, b in of_kind(docs, "ClusterRoleBinding").items() if name != "gpuq-webhook"}
    assert sorted(bindings) == ["gpuq-api", "gpuq-executor"]  # nothing binds the changing role cluster-wide
    for name in ("gpuq-executor", "gpuq-api"):
        assert bindings[name]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                             "name": name}
        assert bindings[name]["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "gpuq-system"}]
    # Only the executor's and the API's pods carry those identities and a token; the others have no token at all.
    for service, deployment in deployments(docs).items():
        pod = deployment["spec"]["template"]["spec"]
        if service in ("executor", "api"):
            assert pod["serviceAccountName"] == f"gpuq-{service}" and pod["automountServiceAccountToken"] is True
        else:
            assert pod["serviceAccountName"] == "gpuq" and pod["automountServiceAccountToken"] is False
    # Without TokenReview the API has no identity of its own either.
    sim = render(SIM_VALUES)
    assert "gpuq-api" not in of_kind(sim, "ClusterRole") and "gpuq-api" not in of_kind(sim, "ServiceAccount")
    api_pod = deployments(sim)["api"]["spec"]["template"]["spec"]
    assert api_pod["serviceAccountName"] == "gpuq" and api_pod["automountServiceAccountToken"] is False


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
        # The writable places a read-only root needs: /tmp only. The secrets key only where it is used.
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        keyed = service in SECRETS_KEY_USERS
        assert mounts["/etc/gpuq"]["readOnly"] is True
        assert set(mounts) == {"/etc/gpuq", "/tmp", *(["/etc/gpuq-secrets"] if keyed else [])}, service
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
        assert "--bind=0.0.0.0" in c["args"]  # the pod's address, where probes and Services reach it
        assert ("--metrics-port=9464" in c["args"]) == (service == "telemetry")
        assert "--metrics-job-labels" not in c["args"]  # job ids stay out of /metrics unless metrics.jobLabels
        assert ("--api-port=8000" in c["args"]) == (service == "api")
        assert ("http" in ports) == (service == "api")
    executor = container(deployments(docs)["executor"])
    assert "--executor=kube" in executor["args"]


def test_singletons_run_a_hot_standby_and_pdbs_keep_one_pod(docs: list[Doc]) -> None:
    pdbs = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p
            for p in of_kind(docs, "PodDisruptionBudget").values()}
    assert set(pdbs) == set(SERVICES)
    for service, deployment in deployments(docs).items():
        spec = deployment["spec"]
        assert spec["replicas"] == (2 if service in REPLICATED else 1), service
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        assert pdbs[service]["spec"]["selector"] == spec["selector"]
        assert pdbs[service]["spec"]["maxUnavailable"] == 1
        spread = spec["template"]["spec"].get("topologySpreadConstraints")
        if service in REPLICATED:  # the standby does not share the leader's node when another one is free
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
    # The Kubernetes executor's mapping (`source: kubernetes`), as the chart's defaults and the CI values give it.
    ci_cluster = parse_cluster(yaml.safe_load(config["data"]["cluster.yaml"]), "rendered cluster.yaml")
    assert ci_cluster.source is ClusterSource.KUBERNETES and ci_cluster.kubernetes is not None
    assert ci_cluster.kubernetes.gpu_flavors == {"NVIDIA-H100-80GB-HBM3": "H100-80GB"}
    default = of_kind(render(sets=MINIMAL), "ConfigMap")["gpuq-config"]
    default_cluster = parse_cluster(yaml.safe_load(default["data"]["cluster.yaml"]), "default cluster.yaml")
    assert default_cluster.source is ClusterSource.KUBERNETES and not default_cluster.node_groups
    default_queues = parse_queues(yaml.safe_load(default["data"]["queues.yaml"]), "default queues.yaml")
    assert [q.name for q in default_queues.queues] == ["default"]

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
    # Without natsAuth: one URL for all, from a Secret (sim values) or plain (no credentials in it).
    sim_env = env_of(container(deployments(render(SIM_VALUES))["scheduler"]))
    assert sim_env["NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gpuq-nats", "key": "url"}
    plain = env_of(container(deployments(render(sets=SHARED_URL))["scheduler"]))
    assert plain["NATS_URL"] == {"name": "NATS_URL", "value": "nats://nats.messaging.svc:4222"}


def test_each_service_connects_as_its_own_bus_user(render: Any, docs: list[Doc]) -> None:
    users = {}
    for service, deployment in deployments(docs).items():
        ref = env_of(container(deployment))["NATS_URL"]["valueFrom"]["secretKeyRef"]
        assert ref["key"] == "url" and ref["name"].startswith("gpuq-nats-")
        users[service] = ref["name"].removeprefix("gpuq-nats-")
    # Its own user, which `gpuq nats-auth` knows; the Kubernetes executor is also the workloads' intake: `kube`.
    assert users == {s: (KUBE if s == "executor" else s) for s in SERVICES}
    assert set(users.values()) <= {*BUS_USERS, KUBE}
    # On the chart's defaults too (issue 43: bus authentication is on unless turned off).
    default = deployments(render(sets=MINIMAL))
    assert {s: env_of(container(d))["NATS_URL"]["valueFrom"]["secretKeyRef"]["name"] for s, d in default.items()} \
        == {s: f"gpuq-nats-{KUBE if s == 'executor' else s}" for s in SERVICES}
    # The simulated executor is only an executor.
    sim = render(SIM_VALUES, sets=["natsAuth.enabled=true", "externalNats.existingSecret.name="])
    ref = env_of(container(deployments(sim)["executor"]))["NATS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "gpuq-nats-executor", "key": "url"}


def test_every_pod_runs_in_the_platform_namespace(render: Any, docs: list[Doc]) -> None:
    for rendered, expected in ((docs, "prod"), (render(SIM_VALUES), "gpuq")):
        for service, deployment in deployments(rendered).items():
            assert env_of(container(deployment))["GPUQ_NAMESPACE"] == {"name": "GPUQ_NAMESPACE",
                                                                        "value": expected}, service


def test_the_secrets_key_is_a_mounted_secret_for_the_services_that_use_it(docs: list[Doc]) -> None:
    for service, deployment in deployments(docs).items():
        c = container(deployment)
        env = env_of(c)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        if service not in SECRETS_KEY_USERS:
            assert "GPUQ_SECRETS_KEY_FILE" not in env and "secrets-key" not in volumes, service
            continue
        assert volumes["secrets-key"]["secret"]["secretName"] == "gpuq-secrets-key"
        assert volumes["secrets-key"]["secret"]["defaultMode"] == 0o440  # root-owned, readable by the pod's group
        (item,) = volumes["secrets-key"]["secret"]["items"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "secrets-key"]
        assert item["key"] == "key" and mount["readOnly"] is True
        assert env["GPUQ_SECRETS_KEY_FILE"]["value"] == f"{mount['mountPath']}/{item['path']}"
        assert "GPUQ_SECRETS_KEY" not in env  # the key itself never in the pod spec


def test_the_api_is_served_inside_and_optionally_through_an_ingress(render: Any, docs: list[Doc]) -> None:
    api = deployments(docs)["api"]
    service = of_kind(docs, "Service")["gpuq-api"]
    assert service["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container(api)["ports"]
    (ingress,) = of_kind(docs, "Ingress").values()
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "gpuq-api-tls", "hosts": ["gpuq.example.com"]}]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "gpuq.example.com"
    (path,) = rule["http"]["paths"]
    assert path["backend"] == {"service": {"name": "gpuq-api", "port": {"name": "http"}}}
    assert not of_kind(render(SIM_VALUES), "Ingress")  # off by default
    # TokenReview's settings reach the API as its environment (services/api/kubeauth.py reads them).
    env = env_of(container(api))
    assert {k: env[k]["value"] for k in env if k.startswith("GPUQ_API_")} == {
        "GPUQ_API_TOKEN_REVIEW": "true", "GPUQ_API_TOKEN_AUDIENCES": "gpuq",
        "GPUQ_API_ADMIN_GROUPS": "platform-admins", "GPUQ_API_TEAM_GROUP_PREFIX": "gpuq:team:"}
    assert not [k for k in env_of(container(deployments(render(SIM_VALUES))["api"])) if k.startswith("GPUQ_API_")]


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


def test_network_policies_allow_only_what_the_services_use(render: Any, docs: list[Doc]) -> None:
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
    kube_api = [{"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}]
    executor = policies["gpuq-executor"]["spec"]
    assert executor["egress"] == kube_api
    # The API: its callers (here only the ingress controller's namespace) on its HTTP port, and the Kubernetes API
    # for TokenReview; without TokenReview, no egress beyond the base policy's.
    api = policies["gpuq-api"]["spec"]
    assert api["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}], "from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]}]
    assert api["policyTypes"] == ["Ingress", "Egress"] and api["egress"] == kube_api
    plain = of_kind(render(sets=MINIMAL), "NetworkPolicy")["gpuq-api"]["spec"]
    assert plain["policyTypes"] == ["Ingress"] and "egress" not in plain
    assert plain["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]


def test_the_executor_changes_workloads_and_pods_only_in_the_managed_namespaces(render: Any) -> None:
    """A RoleBinding of the changing role in each namespace queues.yaml maps to a team and each one
    `rbac.managedNamespaces` adds, and nowhere else."""
    def bound(docs: list[Doc]) -> dict[str, Doc]:
        return {d["metadata"]["namespace"]: d for d in docs  # gpuq-webhook: its certificate's Secret (gpuq-system)
                if d["kind"] == "RoleBinding" and d["metadata"]["name"] != "gpuq-webhook"}

    mapped = bound(render(CI_VALUES))
    assert sorted(mapped) == ["ml-nlp", "ml-vision"]  # config.queues.namespaces
    for binding in mapped.values():
        assert binding["metadata"]["name"] == "gpuq-executor"
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                      "name": "gpuq-executor-workloads"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpuq-executor",
                                        "namespace": "gpuq-system"}]
    extra = bound(render(CI_VALUES, sets=["rbac.managedNamespaces={ml-later,ml-nlp}"]))
    assert sorted(extra) == ["ml-later", "ml-nlp", "ml-vision"]
    assert "gpuq-system" not in extra and not bound(render(sets=MINIMAL))  # nothing mapped: nothing to change


def test_simulated_executor_gets_no_kubernetes_permissions(render: Any) -> None:
    docs = render(SIM_VALUES)
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    assert not of_kind(docs, "RoleBinding")
    assert list(of_kind(docs, "ServiceAccount")) == ["gpuq"]
    executor = deployments(docs)["executor"]
    assert "--executor=sim" in container(executor)["args"]
    assert executor["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "metering" not in deployments(docs)  # a disabled service renders nothing
    assert not of_kind(docs, "NetworkPolicy") and not of_kind(docs, "ServiceMonitor")


def test_nats_and_postgres_come_from_their_own_charts_not_subcharts(render: Any) -> None:
    """No dependencies (an install, lint or package must not need a chart repository), and no values left over
    from the subcharts: the services reach NATS and Postgres only through externalNats/natsAuth and
    externalDatabase (docs/install.md installs NATS and CloudNativePG with their own charts)."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert "dependencies" not in meta
    assert not (CHART / "Chart.lock").exists() and not (CHART / "charts").exists()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert "nats" not in values and "cnpg" not in values
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert "nats" not in schema["properties"] and "cnpg" not in schema["properties"]
    assert schema["additionalProperties"] is False  # so `nats.enabled=true` is refused, not silently ignored
    # A CloudNativePG Cluster's generated app Secret is named like any other.
    env = env_of(container(deployments(render(CI_VALUES, sets=[
        "externalDatabase.existingSecret.name=gpuq-db-app"]))["admission"]))
    assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "gpuq-db-app", "key": "uri"}


def test_job_id_labels_are_exported_only_when_asked_for(render: Any) -> None:
    asked = deployments(render(sets=(*MINIMAL, "metrics.jobLabels=true")))
    assert [s for s, d in asked.items() if "--metrics-job-labels" in container(d)["args"]] == ["telemetry"]


def test_retention_windows_reach_the_services_that_prune(render: Any, docs: list[Doc]) -> None:
    """Metering prunes raw samples, audit drops past months: each gets its own window (shared/retention.py reads
    them, with their floors) and no other service gets either."""
    windows = {"metering": "GPUQ_METERING_RAW_RETENTION_DAYS", "audit": "GPUQ_AUDIT_RETENTION_DAYS"}
    for rendered, expected in ((docs, {"metering": "30", "audit": "400"}),
                               (render(CI_VALUES, sets=["retention.meteringRawDays=0", "retention.auditDays=2555"]),
                                {"metering": "0", "audit": "2555"})):
        for service, deployment in deployments(rendered).items():
            env = env_of(container(deployment))
            for owner, name in windows.items():
                assert (env[name]["value"] if name in env else None) == (expected[owner] if owner == service
                                                                         else None), (service, name)


def test_streams_are_replicated_on_a_clustered_nats(render: Any, docs: list[Doc], helm: Any, chart: Path) -> None:
    """Every service declares the streams it uses with GPUQ_STREAM_REPLICAS: 3 on a NATS cluster (the default, as
    docs/install.md installs NATS), 1 on a single server, or what streams.replicas says; more than one on a single
    server is refused at install time, saying what to set."""
    def replicas(rendered: list[Doc]) -> set[str]:
        return {env_of(container(d))["GPUQ_STREAM_REPLICAS"]["value"] for d in deployments(rendered).values()}

    assert replicas(docs) == {"3"}
    assert replicas(render(CI_VALUES, sets=["streams.natsClustered=false"])) == {"1"}
    assert replicas(render(CI_VALUES, sets=["streams.replicas=5"])) == {"5"}
    res = helm("template", "gpuq", str(chart), "-f", str(CI_VALUES), "--set", "streams.natsClustered=false",
               "--set", "streams.replicas=3")
    assert res.returncode != 0
    assert "streams.replicas=3 needs a NATS cluster: set streams.natsClustered=true" in res.stderr
