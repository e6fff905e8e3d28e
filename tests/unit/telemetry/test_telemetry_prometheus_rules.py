"""The alert rules load (`promtool check rules`) and each alert's unit tests pass (`promtool test rules`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
RULES = DEPLOY / "rules" / "gpuq.rules.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's prometheus package (apt-get install -y prometheus)"
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)


def test_rules_are_valid() -> None:
    res = run("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr


def test_rule_unit_tests_pass() -> None:
    tests = sorted(str(p) for p in (DEPLOY / "tests").glob("*.yml"))
    assert tests
    res = run("test", "rules", *tests)
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {"GpuqAllocatedGpuIdle", "GpuqRepeatedOOMKills", "GpuqQueueWaitP95Rising",
                      "GpuqPreemptionRateHigh", "GpuqQuotaGuaranteesAboveCapacity", "GpuqNodeDegraded",
                      "GpuqUtilizationSourceDown", "GpuqEtaRangeMiscalibrated", "GpuqGpusHeldOutsideGpuq",
                      "GpuqBudgetNearlySpent"}
    tested: set[str] = set()
    for path in (DEPLOY / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            tested |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts <= tested, f"alerts without a firing test: {sorted(alerts - tested)}"
