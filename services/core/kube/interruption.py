"""Spot interruption notices (docs/kubernetes.md, "Spot"): a node the cloud is about to reclaim says so with a taint
its termination handler sets (aws-node-termination-handler's `aws-node-termination-handler/spot-itn`, GKE's
`cloud.google.com/impending-node-termination`; `kubernetes.interruption_taints`). Pure: the shell
(services/executor/kube/interruptions.py) asks the jobs there for a checkpoint and requeues them from it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def notice(node: Mapping[str, Any], taint_keys: Iterable[str]) -> str | None:
    """The interruption notice a node carries, in words (`taint <key>=<value>:<effect>`), or None."""
    keys = set(taint_keys)
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("key") in keys:
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"taint {taint['key']}{value}:{taint.get('effect') or 'NoSchedule'}"
    return None


def requeue_now(*, can_checkpoint: bool, checkpoint_at_notice: str | None, last_checkpoint: str | None,
                noticed_at: float, now: float, wait_s: float) -> str | None:
    """Whether a job on a node under notice is requeued now, and why: once it wrote the checkpoint asked for on the
    notice, or when `wait_s` has passed without one (from its last checkpoint, if any). A job that cannot checkpoint
    is left running: stopping it early would lose its work for nothing; the node's end fails it (NodeFailure)."""
    if not can_checkpoint:
        return None
    if last_checkpoint and last_checkpoint != checkpoint_at_notice:
        return f"requeued from the checkpoint it wrote on the notice, {last_checkpoint}"
    if now - noticed_at >= wait_s:
        since = f"from its last checkpoint, {last_checkpoint}" if last_checkpoint else "from the start"
        return f"no checkpoint within {wait_s:g} s of the notice: requeued {since}"
    return None
