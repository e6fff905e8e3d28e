"""Node failures for a replay: when each node goes down and comes back.

None of the bundled traces records node failures, so they come from a documented, seeded rule
(`gpuq simulate --node-mtbf-h H [--node-repair-h R]`): each node fails independently, the times between its
failures exponential with mean H hours, each repair exponential with mean R hours (at least a minute), over the
trace's submission window. Every policy replays the same failures. A failure kills every job with a pod on the
node: the job loses the work since its last checkpoint (all of it without checkpoints) and goes back to
waiting; the node takes no work until it is back.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shared.domain import NodeSpec

MIN_REPAIR_S = 60


@dataclass(frozen=True, order=True)
class NodeFailure:
    down_at: int  # seconds since the replay origin
    node: str
    up_at: int


def synth_node_failures(nodes: Sequence[NodeSpec], horizon_s: float, mtbf_h: float, repair_h: float,
                        seed: int) -> list[NodeFailure]:
    """Seeded failures of every node within [0, horizon_s), sorted by time then node. The stream of each
    node depends only on the seed and the node's name, so adding a node does not move the others' failures."""
    if mtbf_h <= 0:
        raise ValueError("--node-mtbf-h must be positive")
    if repair_h < 0:
        raise ValueError("--node-repair-h must not be negative")
    out: list[NodeFailure] = []
    for node in sorted(nodes, key=lambda n: n.name):
        rng = random.Random(f"node-failures:{seed}:{node.name}")
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / (mtbf_h * 3600))
            if t >= horizon_s:
                break
            repair = max(MIN_REPAIR_S, rng.expovariate(1.0 / (repair_h * 3600)) if repair_h > 0 else MIN_REPAIR_S)
            out.append(NodeFailure(down_at=int(t), node=node.name, up_at=int(t + repair)))
            t += repair  # a node fails again only after it is back
    return sorted(out)


def lost_work_s(ran_s: float, checkpoint_interval_s: int | None) -> float:
    """Seconds of progress a job killed after running `ran_s` loses: everything since its last periodic
    checkpoint, or all of it when it does not checkpoint."""
    if not checkpoint_interval_s:
        return ran_s
    return ran_s - (ran_s // checkpoint_interval_s) * checkpoint_interval_s
