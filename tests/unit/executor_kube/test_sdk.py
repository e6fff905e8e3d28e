"""The SDK helper's reading side (its patch is tested against the fake API server in tests/system)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpuq_sdk


def test_annotations_file_as_the_downward_api_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "annotations"
    f.write_text('gpuq.io/checkpoint-requested="2026-11-30T10:05:00Z"\n'
                 'gpuq.io/resume-from="s3://b/ckpt \\"7\\""\nkubernetes.io/config.seen="x"\n')
    notes = gpuq_sdk.pod_annotations(f)
    assert notes["gpuq.io/resume-from"] == 's3://b/ckpt "7"'
    assert gpuq_sdk.checkpoint_requested(f)
    assert gpuq_sdk.checkpoint_deadline(f).isoformat() == "2026-11-30T10:05:00+00:00"
    monkeypatch.delenv("GPUQ_RESUME_FROM", raising=False)
    assert gpuq_sdk.resume_from(f) == 's3://b/ckpt "7"'
    monkeypatch.setenv("GPUQ_RESUME_FROM", "s3://env")
    assert gpuq_sdk.resume_from(f) == "s3://env"
    absent = tmp_path / "absent"
    assert gpuq_sdk.pod_annotations(absent) == {} and not gpuq_sdk.checkpoint_requested(absent)


def test_report_outside_a_pod_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(gpuq_sdk.CheckpointReportError, match="KUBERNETES_SERVICE_HOST is unset"):
        gpuq_sdk.report_checkpoint("s3://x", pod="p", namespace="ns", token="t")


def test_sdk_imports_nothing_of_gpuq() -> None:
    tree = ast.parse(Path(gpuq_sdk.__file__).read_text())
    imported = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"shared", "services", "sim", "cli", "pydantic", "httpx", "lightkube"}
