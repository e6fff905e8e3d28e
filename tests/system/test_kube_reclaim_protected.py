"""The quota guarantee on the services when no borrower can checkpoint and every borrower just started: team A's
Job (cannot checkpoint) borrows team B's quota; team B submits within its nominal quota while the borrower is inside
its protection window. Admission asks to reclaim once; the preemption service defers the request until protection
ends, then preempts the borrower, and B's job is placed. Real NATS, real Postgres, the fake API server."""

from __future__ import annotations

from typing import Any

from shared.config import parse_queues
from tests.kube_support import BLOCK, H100, RACK, bus_events, eventually, kube_cluster, kube_stack
from tests.system.test_kube_reclaim import JOB, _suspended, _ungated, job

WINDOW_S = 3  # short, so the test waits seconds; the rule does not depend on its length
QUEUES = parse_queues({
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "namespaces": [{"name": "ml-team-a", "team": "team-a", "queues": ["team-a"]},
                   {"name": "ml-team-b", "team": "team-b", "queues": ["team-b"]}],
    "policy": {"protection_window_s": WINDOW_S, "checkpoint_grace_s": 300},
})


async def test_a_protected_borrower_is_reclaimed_when_its_protection_ends(fresh: tuple[str, str],
                                                                          kube_api: Any) -> None:
    nats_url, database_url = fresh
    fake = kube_api.fake
    for name in ("n1", "n2"):
        fake.add_node(name, gpus=8, gpu_product=H100, labels={BLOCK: "b1", RACK: "r1"})
    for ns in ("ml-team-a", "ml-team-b"):
        await kube_api.create_namespace(ns)
    client = kube_api.client()
    async with kube_api.autopilot(), kube_stack(nats_url, database_url, QUEUES, kube_cluster(), kube_api.kubeconfig,
                                                ("admission", "scheduler", "preemption", "executor")):
        await client.create(JOB(job("sweep", "ml-team-a", "team-a", "low", pods=2, checkpoint=False)))
        await eventually("the borrower's pods ungated", lambda: _ungated(kube_api, "ml-team-a", 2))
        await kube_api.run_pods_to_ready("ml-team-a", "gpuq.io/job", count=2)
        await eventually("JobStarted", lambda: bus_events(nats_url, "job.started"))

        # B comes back within its nominal quota while the borrower is still protected
        await client.create(JOB(job("train", "ml-team-b", "team-b", "high", pods=1, checkpoint=False)))
        preempted = await eventually("JobPreempted", lambda: bus_events(nats_url, "job.preempted"))
        assert preempted[0]["reason"] == "ReclaimQuota" and preempted[0]["checkpoint_uri"] is None
        assert preempted[0]["preemption_id"].endswith("/retry-1")  # the deferred request, run again
        requests = await eventually("PreemptionRequested", lambda: bus_events(nats_url, "preemption.requested"))
        assert len(requests) == 1  # admission asked once; the preemption service kept the request
        assert await eventually("the borrower suspended", lambda: _suspended(client, "ml-team-a", "sweep"))
        fake.advance(60)  # the suspended Job's pods finish their grace period
        await eventually("the lender's pod ungated", lambda: _ungated(kube_api, "ml-team-b", 1))
        placed = await eventually("JobPlaced for the lender", lambda: _placed(nats_url, "train"))
        assert placed


async def _placed(nats_url: str, name: str) -> list[dict[str, Any]] | None:
    events = [e for e in await bus_events(nats_url, "job.placed") if name in e["job_id"]]
    return events or None
