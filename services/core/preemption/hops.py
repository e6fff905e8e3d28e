"""Hops per preemption: how many bus handoffs one preemption takes, from the request to the preemptor's placement.

A hop is one event one service hands to another on the preemption's causal chain. Measured over an event history
(CloudEvents as JSON documents: `type`, `id`, `time`, `data`), following ids, not arrival order:

  PreemptionRequested (admission or the scheduler; its event id is the protocol's preemption_id)
  -> CheckpointRequested (preemption -> the victim's executor), when the victim can checkpoint
  -> JobCheckpointed (the executor -> preemption), when it checkpointed before the grace ran out
  -> JobPreempted (preemption -> scheduler and admission)
  -> JobAdmitted of the preemptor (admission -> scheduler), when it waited for quota (a reclaim)
  -> JobPlaced of the preemptor (scheduler -> executor): the preemption has done its work.

Used by the system test of the reclaim story (tests/system/test_reclaim_scenario.py), which prints the chain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

_T = "io.gpuq."


@dataclass(frozen=True)
class PreemptionChain:
    preemption_id: str
    victim: str
    preemptor: str
    steps: tuple[str, ...]  # event types (short: "preemption.requested", ...) in causal order

    @property
    def hops(self) -> int:
        return len(self.steps)


def _short(event_type: str) -> str:
    """`io.gpuq.job.placed.v1` -> `job.placed`."""
    name = event_type.removeprefix(_T)
    return name.rsplit(".", 1)[0] if name.rsplit(".", 1)[-1].startswith("v") else name


def _at(event: Mapping[str, Any]) -> datetime:
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00"))


def preemption_chains(events: Iterable[Mapping[str, Any]]) -> list[PreemptionChain]:
    """One chain per JobPreempted in `events`, in the order of (preemption id, victim)."""
    by_type: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        by_type.setdefault(_short(str(e["type"])), []).append(e)
    requests = {str(e["id"]): e for e in by_type.get("preemption.requested", [])}
    chains: list[PreemptionChain] = []
    for done in sorted(by_type.get("job.preempted", []),
                       key=lambda e: (str(e["data"].get("preemption_id")), str(e["data"]["job_id"]))):
        pid, victim = str(done["data"].get("preemption_id") or ""), str(done["data"]["job_id"])
        preemptor = str(done["data"].get("preemptor") or "")
        steps: list[str] = []
        # A deferred request re-runs as `<original id>/retry-<n>`: the original event started the chain.
        if pid.split("/retry-", 1)[0] in requests:
            steps.append("preemption.requested")
        for kind in ("job.checkpoint_requested", "job.checkpointed"):
            if any(e["data"].get("job_id") == victim and e["data"].get("preemption_id") == pid
                   for e in by_type.get(kind, [])):
                steps.append(kind)
        steps.append("job.preempted")
        after = _at(done)
        for kind in ("job.admitted", "job.placed"):  # the preemptor's next ones, once the victim was preempted
            if any(e["data"].get("job_id") == preemptor and _at(e) >= after for e in by_type.get(kind, [])):
                steps.append(kind)
        chains.append(PreemptionChain(preemption_id=pid, victim=victim, preemptor=preemptor, steps=tuple(steps)))
    return chains
