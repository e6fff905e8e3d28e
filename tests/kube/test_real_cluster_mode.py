"""The GPUQ_KUBECONFIG path of the kube_api fixture, exercised without a real cluster: a fake with its actors on
autopilot poses as the real cluster, and a child pytest runs the portable tests against its kubeconfig, so the
fixture yields a RealCluster whose helpers wait instead of driving actors."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.kube.kubefake.cluster import KubeCluster
from tests.kube.kubefake.resources import NAMESPACES

ROOT = Path(__file__).resolve().parents[2]


async def test_the_portable_tests_pass_against_a_cluster_given_by_gpuq_kubeconfig(kube_api: KubeCluster) -> None:
    fake = kube_api.fake
    fake.add_node("worker-1", cpu="8", memory="32Gi")
    env = {**os.environ, "GPUQ_KUBECONFIG": str(kube_api.kubeconfig)}
    async with kube_api.autopilot():
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "kube",
            "tests/kube/test_portable.py",
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(child.communicate(), 170)
    report = output.decode()
    assert child.returncode == 0, report
    assert "3 passed" in report, report
    # RealCluster.cleanup deleted the namespaces the child's tests created, and nothing else.
    remaining = {ns["metadata"]["name"] for ns in fake.store.list(NAMESPACES)}
    assert remaining == {"default", "kube-system", "kube-public", "kube-node-lease"}
