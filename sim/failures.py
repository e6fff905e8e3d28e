"""Node failures for a replay: when each node goes down and comes back.

None of the bundled traces records node failures, so they come from a documented, seeded rule
(`gpuq simulate --node-mtbf-h H [--node-repair-h R]`): each node fails independently, the times between its
failures exponential with mean H hours, each repair exponential with mean R hours (at least a minute), over the
trace's submission window. Every policy replays the same failures. A failure kills every job with a pod on the
node: the job loses the work since its last checkpoint (all of it without checkpoints) and goes back to
waiting; the node takes no work until it is back.

Spot interruptions (`--spot-mtbi-h H`, docs/simulator.md "Spot"): the spot nodes (those labelled `gpuq.io/spot=true`,
else a seeded `--spot-share` of the nodes, chosen by name) are reclaimed by the cloud, the times between one node's
interruptions exponential with mean H hours, its replacement back after `--spot-replace-h` (exponential mean, at
least a minute). Each interruption may come with a notice (`--spot-notice-s`, AWS gives 120 s, GCP 30 s): gpuq asks
the jobs there for a checkpoint at once, so a job that can checkpoint and writes its checkpoint
(`--spot-checkpoint-s`) within the notice loses nothing; one that cannot, or whose write does not fit the notice,
loses what it did since its last periodic checkpoint, as on a failure without notice.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shared.domain import NodeSpec

MIN_REPAIR_S = 60
SPOT_LABEL = "gpuq.io/spot"  # a node labelled "true" is spot capacity


@dataclass(frozen=True, order=True)
class NodeFailure:
    down_at: int  # seconds since the replay origin
    node: str
    up_at: int
    notice_s: int = 0  # interruption notice before down_at (spot); 0: none
    checkpoint_s: int = 0  # how long a job takes to write a checkpoint asked for on the notice


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


def spot_nodes(nodes: Sequence[NodeSpec], share: float, seed: int) -> list[NodeSpec]:
    """The spot nodes: those labelled gpuq.io/spot=true; without any, a seeded `share` of the nodes (each node's
    draw depends only on the seed and its name)."""
    if not 0 <= share <= 1:
        raise ValueError("--spot-share must be between 0 and 1")
    labelled = [n for n in nodes if n.labels.get(SPOT_LABEL) == "true"]
    if labelled:
        return sorted(labelled, key=lambda n: n.name)
    return sorted((n for n in nodes if random.Random(f"spot:{seed}:{n.name}").random() < share),
                  key=lambda n: n.name)


def synth_spot_interruptions(nodes: Sequence[NodeSpec], horizon_s: float, mtbi_h: float, replace_h: float,
                             notice_s: int, checkpoint_s: int, seed: int) -> list[NodeFailure]:
    """Seeded interruptions of the spot nodes `nodes` within [0, horizon_s), each with `notice_s` of notice."""
    if notice_s < 0 or checkpoint_s < 0:
        raise ValueError("--spot-notice-s and --spot-checkpoint-s must not be negative")
    return [NodeFailure(f.down_at, f.node, f.up_at, notice_s, checkpoint_s)
            for f in synth_node_failures(nodes, horizon_s, mtbi_h, replace_h, seed + 7919)]


def lost_work_s(ran_s: float, checkpoint_interval_s: int | None, failure: NodeFailure | None = None) -> float:
    """Seconds of progress a job killed after running `ran_s` loses: everything since its last periodic
    checkpoint, or all of it when it does not checkpoint. With an interruption notice long enough for the
    checkpoint it is asked for, a job that can checkpoint loses nothing (it is requeued from that checkpoint)."""
    if not checkpoint_interval_s:
        return ran_s
    if failure is not None and failure.notice_s > 0 and failure.checkpoint_s <= failure.notice_s:
        return 0.0
    return ran_s - (ran_s // checkpoint_interval_s) * checkpoint_interval_s
