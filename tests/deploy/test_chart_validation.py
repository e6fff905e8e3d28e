"""The chart and the image recipe pass the real linters and schemas offline: `helm lint --strict`, `helm template` and
`helm package` on the chart's own directory, the rendered manifests against the Kubernetes JSON schemas
(`kubernetes-validate --strict`), the ServiceMonitor and PrometheusRule against prometheus-operator's schemas,
values.schema.json as helm enforces it, and hadolint on the Dockerfile. Each check is also shown to fail on a bad
input, so that a green run means something."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuq"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
SIM_VALUES = CHART / "ci" / "sim-values.yaml"
# The oldest Kubernetes the chart declares (Chart.yaml kubeVersion), the kubectl/helm client's, and the newest
# that kubernetes-validate ships schemas for.
KUBE_VERSIONS = ("1.29.0", "1.35.0", "1.37.0")

Doc = dict[str, Any]


def kubernetes_validate(tools: Any, docs: list[Doc], version: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    manifest = tmp_path / f"rendered-{version}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return subprocess.run([str(tools.kubernetes_validate), "--strict", "-k", version, str(manifest)],
                          capture_output=True, text=True, timeout=120)


def validate_crs(tools: Any, docs: list[Doc]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(ROOT / "deploy" / "tools" / "validate-crs.mjs"), str(tools.crd_schemas)],
                          input=json.dumps(docs), capture_output=True, text=True, timeout=120)


def test_helm_lint_strict(helm: Any, chart: Path) -> None:
    for values in (CI_VALUES, SIM_VALUES):
        res = helm("lint", "--strict", str(chart), "-f", str(values))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in res.stdout


def test_the_chart_packages_offline_and_the_package_is_the_chart(helm: Any, chart: Path, tmp_path: Path) -> None:
    """`helm package` on the chart's own directory, with no network and no helm state (the helm fixture), then the
    package linted strictly and rendered: what an air-gapped install gets. The package holds the rules and
    dashboards themselves (helm follows the links) and renders exactly what the directory renders."""
    version = yaml.safe_load((chart / "Chart.yaml").read_text())["version"]
    res = helm("package", str(chart), "--destination", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    package = tmp_path / f"gpuq-{version}.tgz"
    with tarfile.open(package) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert not [n for n in members if n.startswith("gpuq/charts/")]  # nothing vendored, nothing missing
    for linked, source in (("prometheus-rules", ROOT / "deploy" / "prometheus" / "rules"),
                           ("dashboards", ROOT / "deploy" / "grafana" / "dashboards")):
        for path in source.iterdir():
            assert members[f"gpuq/files/{linked}/{path.name}"].isfile(), path
    res = helm("lint", "--strict", str(package), "-f", str(CI_VALUES))
    assert res.returncode == 0 and "1 chart(s) linted, 0 chart(s) failed" in res.stdout, res.stdout + res.stderr
    rendered = [helm("template", "gpuq", str(source), "--namespace", "gpuq-system", "-f", str(CI_VALUES))
                for source in (package, chart)]
    assert all(r.returncode == 0 for r in rendered), [r.stderr for r in rendered]
    assert rendered[0].stdout == rendered[1].stdout


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_manifests_pass_the_kubernetes_schemas_strictly(render: Any, tools: Any, version: str,
                                                                  tmp_path: Path) -> None:
    for values in ((CI_VALUES,), (SIM_VALUES,)):
        docs = [d for d in render(*values, kube_version=version) if d["apiVersion"] != "monitoring.coreos.com/v1"]
        res = kubernetes_validate(tools, docs, version, tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        passed = re.findall(r"^INFO .* passed for resource", res.stdout + res.stderr, re.MULTILINE)
        assert len(passed) == len(docs), res.stdout + res.stderr  # every document had a schema and passed it


def test_kubernetes_validate_catches_a_field_kubernetes_does_not_know(render: Any, tools: Any,
                                                                      tmp_path: Path) -> None:
    docs = [d for d in render(CI_VALUES) if d["kind"] == "Deployment"]
    docs[0]["spec"]["template"]["spec"]["securityContext"]["runAsNonRot"] = True  # a typo an operator could make
    res = kubernetes_validate(tools, docs, "1.35.0", tmp_path)
    assert res.returncode != 0 and "runAsNonRot" in res.stdout + res.stderr


def test_monitoring_resources_pass_the_prometheus_operator_schemas(render: Any, tools: Any) -> None:
    crs = [d for d in render(CI_VALUES) if d["apiVersion"] == "monitoring.coreos.com/v1"]
    assert sorted(d["kind"] for d in crs) == ["PrometheusRule", "ServiceMonitor"]
    res = validate_crs(tools, crs)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ok   ") == 2

    # The same check refuses what Prometheus would reject.
    bad_rule = json.loads(json.dumps(next(d for d in crs if d["kind"] == "PrometheusRule")))
    bad_rule["spec"]["groups"][-1]["rules"][0]["for"] = "30 minutes"
    bad_monitor = json.loads(json.dumps(next(d for d in crs if d["kind"] == "ServiceMonitor")))
    bad_monitor["spec"]["endpoints"][0]["port"] = 9464  # a port *name* is required
    res = validate_crs(tools, [bad_rule, bad_monitor])
    assert res.returncode == 1
    assert "FAIL PrometheusRule/gpuq: data/spec/groups/1/rules/0/for must match pattern" in res.stdout
    assert "FAIL ServiceMonitor/gpuq: data/spec/endpoints/0/port must be string" in res.stdout


@pytest.mark.parametrize(("setting", "complaint"), [
    ("services.telemetry.replicas=2", "at '/services/telemetry/replicas': maximum: got 2, want 1"),
    ("securityContext.readOnlyRootFilesystem=false", "at '/securityContext/readOnlyRootFilesystem'"),
    ("podSecurityContext.runAsNonRoot=false", "at '/podSecurityContext/runAsNonRoot'"),
    ("services.executor.kind=docker", "at '/services/executor/kind'"),
    ("image.digest=latest", "at '/image/digest'"),
    ("externalNats.url=nats://admin:secret@nats:4222", "at '/externalNats/url'"),  # credentials belong in a Secret
    ("metrics.serviceMonitor.interval=30", "at '/metrics/serviceMonitor/interval'"),
    ("servics.admission.replicas=3", "additional properties 'servics' not allowed"),  # a typo is not ignored
    ("platformNamespace=Prod_1", "at '/platformNamespace'"),  # not a valid subject token / stream prefix
    ("services.api.ingress.host=", "at '/services/api/ingress/host': minLength"),  # an ingress needs its host
    ("services.api.service.type=ExternalName", "at '/services/api/service/type'"),
    ("natsAuth.secretPrefix=Gpuq_", "at '/natsAuth/secretPrefix'"),  # not a Secret name
    ("nats.enabled=true", "additional properties 'nats' not allowed"),  # the subcharts are gone: no silent no-op
    ("retention.auditDays=10", "at '/retention/auditDays'"),  # below the floor the database enforces
    ("retention.meteringRawDays=2", "at '/retention/meteringRawDays'"),  # a redelivered sample would count twice
])
def test_values_schema_rejects_bad_values(helm: Any, chart: Path, setting: str, complaint: str) -> None:
    res = helm("template", "gpuq", str(chart), "-f", str(CI_VALUES), "--set", setting)
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in res.stderr and complaint in res.stderr, res.stderr


def test_missing_nats_postgres_or_secrets_key_is_a_clear_error(helm: Any, chart: Path) -> None:
    # NATS: bus users by Secret are the default; turned off, a URL is needed.
    res = helm("template", "gpuq", str(chart), "--set", "natsAuth.enabled=false")
    assert res.returncode != 0 and "NATS: set natsAuth.enabled (a bus user per service, by Secret), " \
        "externalNats.url, or externalNats.existingSecret.name" in res.stderr
    # An externalNats left from before natsAuth was the default is refused, not silently ignored.
    res = helm("template", "gpuq", str(chart), "--set", "externalNats.url=nats://nats:4222")
    assert res.returncode != 0 and "NATS: natsAuth.enabled is on (the default" in res.stderr \
        and "set natsAuth.enabled=false" in res.stderr
    res = helm("template", "gpuq", str(chart))
    assert res.returncode != 0 and "Postgres: set externalDatabase.existingSecret.name" in res.stderr
    res = helm("template", "gpuq", str(chart), "--set", "externalDatabase.existingSecret.name=db")
    assert res.returncode != 0 and "secretsKey.existingSecret.name: api keeps webhook signing secrets encrypted" \
        in res.stderr
    # Without the two services that keep webhook secrets, no key is needed.
    res = helm("template", "gpuq", str(chart), "--set", "externalDatabase.existingSecret.name=db",
               "--set", "services.api.enabled=false", "--set", "services.telemetry.enabled=false")
    assert res.returncode == 0, res.stderr


def hadolint(tools: Any, dockerfile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools.hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True,
                          timeout=60)


def test_dockerfile_lints_clean_and_builds_a_pinned_non_root_image(tools: Any, tmp_path: Path) -> None:
    dockerfile = ROOT / "Dockerfile"
    res = hadolint(tools, dockerfile)
    assert res.returncode == 0, res.stdout + res.stderr
    text = dockerfile.read_text()
    stages = re.findall(r"^FROM (\S+) ?(?:AS (\S+))?$", text, re.MULTILINE)
    assert [name for _, name in stages] == ["base", "build", ""]  # multi-stage: the runtime gets no build leftovers
    base = stages[0][0]
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base)  # pinned by digest
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert re.search(r'^ENTRYPOINT \["gpuq"\]$', text, re.MULTILINE)  # JSON form: signals reach gpuq directly
    assert "[embedded]" not in text and "pgserver" not in text  # no servers inside the image

    # hadolint has teeth: the same file with an unpinned base and a root user fails.
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace(base, "python:latest").replace("USER 10001:10001", "USER root"))
    res = hadolint(tools, bad)
    assert res.returncode != 0 and "DL3007" in res.stdout and "DL3002" in res.stdout
