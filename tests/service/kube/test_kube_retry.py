"""The Kubernetes executor and a job's retry policy (the `gpuq.io/retry-*` annotations), against the fake API
server with real NATS and Postgres: a failure gpuq sees on a live workload is one failed attempt, retried after its
backoff on another placement; without a policy the same failure is final, as before."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tests.kube_support import bus_events, eventually, fetchval, kube_cluster, kube_stack
from tests.service.kube.test_kube_executor import QUEUES, events_of, job, live_pods, setup


async def test_a_node_failure_is_retried_after_the_backoff_on_another_node(fresh: tuple[str, str],
                                                                           kube_api: Any) -> None:
    nats_url, database_url = fresh
    client = await setup(kube_api)
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig):
        await client.create(job("flaky", gpus=4, annotations={"gpuq.io/retry-backoff-limit": "2",
                                                              "gpuq.io/retry-backoff-s": "1"}))
        (started,) = await eventually("JobStarted", lambda: events_of(nats_url, "started"))
        (node,) = started["nodes"]
        other = "n2" if node == "n1" else "n1"
        kube_api.fake.kubelet.set_node_ready(node, False)
        (attempt,) = await eventually("JobAttemptFailed", lambda: events_of(nats_url, "attempt_failed"))

        async def moved() -> Any:
            pods = [p for p in await live_pods(kube_api) if p["metadata"]["name"].startswith("flaky")
                    and not p["spec"].get("schedulingGates")
                    and p["metadata"]["annotations"].get("gpuq.io/binding", "").startswith("2/")]
            return pods or None

        (again,) = await eventually("the retried job on the other node", moved)
        assert again["spec"]["nodeSelector"]["kubernetes.io/hostname"] == other
        await eventually("started again", lambda: _count(events_of(nats_url, "started"), 2))
    assert attempt["exit_reason"] == "NodeFailure" and attempt["attempt"] == 1 and attempt["attempts_allowed"] == 3
    assert "attempt 1 of 3 failed, retrying after 1 s" in attempt["message"]
    assert await events_of(nats_url, "failed") == []
    placed = [e for e in await bus_events(nats_url, "job.placed")]
    assert len(placed) == 2
    assert datetime.fromisoformat(placed[1]["placed_at"]) >= datetime.fromisoformat(attempt["retry_not_before"])
    assert await fetchval(database_url, "SELECT failures FROM executor.kube_jobs") == 1


async def _count(value: Any, n: int) -> Any:
    items = await value
    return items if len(items) >= n else None
