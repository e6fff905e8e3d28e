"""`helm test`'s pod (templates/tests/smoke.yaml): it runs `gpuq smoke` with arguments the real command accepts (the
same flags tests/service/security/test_smoke.py runs against a platform), holds the database credential only to mint
and revoke its token (none at all with tests.smoke.tokenSecret), runs as restricted as the services, and reaches the
API through NetworkPolicies of its own. (kubernetes-validate checks it with every rendered document:
test_chart_validation.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import typer.main

from cli.main import app

from .test_chart import CI_DIGEST, CI_VALUES, MINIMAL, SIM_VALUES

Doc = dict[str, Any]
IMAGE = f"registry.example.com/platform/gpuq@sha256:{CI_DIGEST}"


def smoke_pod(docs: Sequence[Doc]) -> Doc:
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    return pod


def parsed(args: list[str]) -> dict[str, Any]:
    """The options `gpuq smoke` reads from these arguments (click parses them as the command would; nothing runs)."""
    group = typer.main.get_command(app)
    command = group.get_command(typer.Context(group), args[0])  # type: ignore[attr-defined]  # (a group's)
    assert command is not None
    ctx = command.make_context(args[0], args[1:], resilient_parsing=False)
    return dict(ctx.params)


def test_the_test_hook_runs_gpuq_smoke_through_the_api_with_a_token_minted_for_it(render: Any) -> None:
    """With the CI values: as the first team queues.yaml maps a namespace to (vision, in ml-vision), in its queue."""
    pod = smoke_pod(render(CI_VALUES))
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["annotations"] == {"helm.sh/hook": "test",
                                   "helm.sh/hook-delete-policy": "before-hook-creation,hook-succeeded"}
    assert meta["labels"]["app.kubernetes.io/component"] == "smoke-test"
    (container,) = spec["containers"]
    assert container["image"] == IMAGE
    assert container["args"] == [
        "smoke", "--api-url=http://gpuq-api.gpuq-system.svc:8000", "--team=vision", "--queue=vision",
        "--priority=normal", "--wait-for=placed", "--timeout=180", f"--image={IMAGE}"]
    options = parsed(container["args"])
    assert options["api_url"] == "http://gpuq-api.gpuq-system.svc:8000" and options["wait_for"] == "placed"
    assert options["timeout"] == 180.0 and options["image"] == IMAGE
    # The database credential, only to mint and revoke the run's team token; nothing else secret.
    assert container["env"] == [{"name": "DATABASE_URL",
                                 "valueFrom": {"secretKeyRef": {"name": "gpuq-database", "key": "uri"}}}]
    # As restricted as the services, and no Kubernetes credential.
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "gpuq"
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 180 + 300
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_a_token_secret_leaves_the_database_out_of_the_test_pod(render: Any) -> None:
    pod = smoke_pod(render(CI_VALUES, sets=["tests.smoke.tokenSecret.name=gpuq-smoke-token"]))
    (container,) = pod["spec"]["containers"]
    assert container["env"] == [{"name": "GPUQ_TOKEN",
                                 "valueFrom": {"secretKeyRef": {"name": "gpuq-smoke-token", "key": "token"}}}]


def test_a_cluster_without_gpus_waits_for_admission_and_the_simulated_executor_gets_no_pod_image(render: Any) -> None:
    pod = smoke_pod(render(SIM_VALUES, sets=["tests.smoke.waitFor=admitted", "tests.smoke.team=team-a",
                                             "tests.smoke.gpuModels={H100-80GB,A100-80GB}",
                                             "tests.smoke.timeoutSeconds=60"]))
    args = pod["spec"]["containers"][0]["args"]
    assert "--wait-for=admitted" in args and "--team=team-a" in args and "--queue=team-a" in args
    assert not [a for a in args if a.startswith("--image")]  # the simulated executor runs no pod
    options = parsed(args)
    assert list(options["gpu_model"]) == ["H100-80GB", "A100-80GB"] and options["timeout"] == 60.0


def test_the_test_pod_and_only_it_reaches_the_api(render: Any) -> None:
    docs = render(CI_VALUES)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    smoke = {"app.kubernetes.io/name": "gpuq", "app.kubernetes.io/instance": "gpuq",
             "app.kubernetes.io/component": "smoke-test"}
    api = {**smoke, "app.kubernetes.io/component": "api"}
    assert policies["gpuq-smoke-test"] == {
        "podSelector": {"matchLabels": smoke}, "policyTypes": ["Egress"],
        "egress": [{"to": [{"podSelector": {"matchLabels": api}}], "ports": [{"port": 8000, "protocol": "TCP"}]}]}
    assert policies["gpuq-api-from-smoke-test"] == {
        "podSelector": {"matchLabels": api}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": smoke}}],
                     "ports": [{"port": "http", "protocol": "TCP"}]}]}
    # gpuq's default policy selects the test pod too (DNS and Postgres out, nothing in but the health port).
    base = policies["gpuq"]["podSelector"]["matchLabels"]
    assert base.items() <= smoke_pod(docs)["metadata"]["labels"].items()


def test_the_team_and_queue_are_chosen_from_queues_yaml_unless_given(render: Any) -> None:
    def team_and_queue(*sets: str) -> list[str]:
        args = smoke_pod(render(CI_VALUES, sets=list(sets)))["spec"]["containers"][0]["args"]
        return [a for a in args if a.startswith(("--team=", "--queue="))]

    assert team_and_queue("tests.smoke.team=nlp") == ["--team=nlp", "--queue=nlp"]  # the queue nlp may use
    assert team_and_queue("tests.smoke.team=nlp", "tests.smoke.queue=vision") == ["--team=nlp", "--queue=vision"]
    # On the chart's own queues.yaml (no namespaces): its first queue's team.
    args = smoke_pod(render(sets=list(MINIMAL)))["spec"]["containers"][0]["args"]
    assert "--team=default" in args and "--queue=default" in args


def test_the_smoke_test_can_be_left_out(render: Any) -> None:
    for sets in (["tests.smoke.enabled=false"], ["services.api.enabled=false", "services.telemetry.enabled=false"]):
        docs = render(sets=[*MINIMAL, *sets])
        assert not [d for d in docs if d["kind"] == "Pod" or "smoke" in d["metadata"]["name"]]


@pytest.mark.parametrize(("setting", "complaint"), [
    ("tests.smoke.waitFor=running", "at '/tests/smoke/waitFor'"),
    ("tests.smoke.timeoutSeconds=5", "at '/tests/smoke/timeoutSeconds'"),
    ("tests.smoke.timeoutSeconds=7200", "at '/tests/smoke/timeoutSeconds'"),
    ("tests.smoke.tokenSecret.key=", "at '/tests/smoke/tokenSecret/key'"),
])
def test_the_values_schema_refuses_a_bad_smoke_test(helm: Any, chart: Path, setting: str, complaint: str) -> None:
    res = helm("template", "gpuq", str(chart), "-f", str(CI_VALUES), "--set", setting)
    assert res.returncode != 0 and complaint in res.stderr, res.stderr
