"""The seed's reclaim story, shared by the system tests that run it: two teams of one cohort on two 8-GPU nodes;
team A's low-priority, checkpointing job borrows team B's idle GPUs; team B's high-priority job reclaims them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from shared.config import parse_cluster, parse_queues
from shared.domain import CheckpointSpec, JobSpec, PodSet

CLUSTER = parse_cluster({"node_groups": [
    {"name": "h100", "count": 2, "gpus_per_node": 8, "gpu_model": "H100-80GB", "cpu_milli": 96000,
     "memory_mib": 1048576, "nodes_per_rack": 2},
]})
QUEUES_DOC: dict[str, Any] = {
    "priority_classes": [{"name": "high", "value": 500, "preemptible": False},
                         {"name": "low", "value": 0, "preemptible": True}],
    "cohorts": [{"name": "research"}],
    "queues": [
        {"name": "team-a", "cohort": "research", "teams": ["team-a"], "quotas": {"H100-80GB": {"nominal": 8}}},
        {"name": "team-b", "cohort": "research", "teams": ["team-b"], "quotas": {"H100-80GB": {"nominal": 8}}},
    ],
    "policy": {"protection_window_s": 60, "checkpoint_grace_s": 300},
}
QUEUES = parse_queues(QUEUES_DOC)
# Team A's sweep: both nodes, 2000 s of work, checkpoints supported.
BORROWER = JobSpec(job_id="a-sweep", team="team-a", queue="team-a", priority_class="low",
                   pod_sets=(PodSet(count=2, gpus_per_pod=8),), checkpoint=CheckpointSpec(supported=True),
                   max_runtime_s=4000, labels={"sim.gpuq.io/duration-s": "2000"})


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 90.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.1)
