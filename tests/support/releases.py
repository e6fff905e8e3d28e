"""The previous release's source, from the repository's own history: what `deploy/previous-release` names.

The rolling-upgrade test runs its services beside this tree's, and the contract test has its models read what this
tree writes. Both fail (never skip) when the history is not there, saying what is missing and how to fetch it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS_RELEASE = ROOT / "deploy" / "previous-release"


def previous_release_commit() -> str:
    """The full commit hash `deploy/previous-release` names (its one line that is not a comment)."""
    lines = [ln.strip() for ln in PREVIOUS_RELEASE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) != 1 or len(lines[0]) != 40:
        pytest.fail(f"{PREVIOUS_RELEASE} must name one full commit hash (git rev-parse <release>), not {lines}")
    return lines[0]


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=120)


def materialise(commit: str, dest: Path) -> None:
    """The source tree of `commit`, from this repository's history, extracted into `dest`. Fails saying what is
    missing (git, a checkout, the commit in a shallow clone) and how to get it."""
    try:
        inside = _git("rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        pytest.fail("git is needed to take the previous release (deploy/previous-release) from the repository's "
                    "history")
    if inside.returncode != 0 or inside.stdout.strip() != b"true":
        pytest.fail(f"{ROOT} is not a git checkout: the previous release ({commit}, deploy/previous-release) is taken "
                    "from the repository's history; run the tests in a clone")
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        why = "this clone is shallow" if shallow else "this clone does not have it"
        pytest.fail(f"the previous release's commit {commit} (deploy/previous-release) is not in the repository's "
                    f"history: {why}. Fetch it: git fetch --unshallow (or git fetch origin {commit})")
    archive = _git("archive", "--format=tar", commit)
    assert archive.returncode == 0, archive.stderr.decode()
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


@contextlib.contextmanager
def previous_release() -> Iterator[Path]:
    """The previous release's tree in a temporary directory (removed afterwards), checked to import with this
    environment's interpreter and packages, from its own files (this environment's editable install points at this
    tree: PYTHONPATH must win)."""
    with tempfile.TemporaryDirectory(prefix="gpuq-previous-release-") as tmp:
        tree = Path(tmp)
        materialise(previous_release_commit(), tree)
        probe = run_python(tree, "import cli.main, services.stack, shared; print(shared.__file__)")
        assert probe.returncode == 0, \
            f"the previous release does not import with this environment's packages:\n{probe.stderr}"
        assert Path(probe.stdout.strip()).is_relative_to(tree), probe.stdout
        yield tree


def release_env(tree: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a process of the release at `tree` runs with: its source first on the path."""
    return {**(os.environ if env is None else env), "PYTHONPATH": str(tree)}


def run_python(tree: Path, code: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`code` run by this interpreter in the release at `tree`."""
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=release_env(tree), input=stdin,
                          capture_output=True, text=True, timeout=120)
