"""Defragmentation moves in the preemption service: the protocol's half (docs/preemption.md, "Defragmentation").

The scheduler owns placement and knows fragmentation: it plans a move (services/scheduler/defrag.py, the pure core
services/core/pipeline/defrag.py) and asks with a PreemptionRequested of reason DefragmentationMove, preemptor the
gang, candidates the jobs to move. This service owns the protocol state, so it decides whether the moves may be made
now, all or none, on its own records, before opening the checkpoint-before-preempt protocol for them:
- defragmentation is enabled in the queue configuration in force, and victims checkpoint first (a grace above 0);
- every candidate still runs, is in no open protocol and is movable (`why_not_movable`: it can checkpoint, is of a
  preemptible non-production class, past its protection window, of a priority not above the gang's, not moved within
  `job_cooldown_s`, on whole GPUs);
- the cluster-wide bound: the moves of the last sliding hour (this schema's DefragmentationMove protocols that were
  not aborted) plus these stay within `max_moves_per_hour`;
- the guard rails of any preemption: the gang was not itself preempted within the cool-down, and its queue's
  `max_preemptions_per_hour` counts the moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg

from services.core.pipeline.defrag import Memory, Running, why_not_movable
from services.core.preemption import Outcome, cooldown_verdict, priority_of, rate_limit_verdict
from services.core.preemption.guards import HOUR_S
from services.preemption.store import Snapshot, run_started
from shared.config import QueuesConfig
from shared.domain import JobSpec
from shared.events import PreemptionReason

# The moves of the last hour, and when each job was last moved (this schema's records: the protocol's state).
RECENT_MOVES = ("SELECT victim, requested_at FROM preemption.preemptions WHERE reason = $1 AND state <> 'aborted' "
                "AND requested_at > $2 ORDER BY requested_at, victim")


@dataclass(frozen=True)
class Verdict:
    """What becomes of a move request: STARTED with its victims, or the outcome and why not."""

    outcome: str
    message: str
    victims: tuple[str, ...] = ()


def judge(config: QueuesConfig, gang: JobSpec, candidates: Iterable[str], snap: Snapshot, memory: Memory,
          now: float, *, gang_last_preempted: float | None, queue_recent: Iterable[float]) -> Verdict:
    """Whether the moves may be made now (the module docstring): all of them, or none. Pure."""
    settings = config.policy.defragmentation
    wanted = tuple(dict.fromkeys(candidates))
    if not settings.enabled:
        return Verdict(Outcome.NO_VICTIMS, "defragmentation is off (policy.defragmentation.enabled)")
    if config.policy.checkpoint_grace_s <= 0:
        return Verdict(Outcome.NO_VICTIMS, "defragmentation moves only with a checkpoint first "
                                           "(policy.checkpoint_grace_s is 0)")
    if not wanted:
        return Verdict(Outcome.NO_VICTIMS, "no job to move was named")
    why = cooldown_verdict(config, gang_last_preempted, now)
    if why is not None:
        return Verdict(Outcome.COOLDOWN, why)
    gang_priority = priority_of(config, gang)[0]
    refused: list[str] = []
    for job_id in wanted:
        fact = snap.placements.get(job_id)
        if fact is None:
            refused.append(f"{job_id} (not running)")
        elif job_id in snap.busy:
            refused.append(f"{job_id} (already being preempted)")
        elif (not_movable := why_not_movable(job_id, Running(fact.spec, run_started(fact)), gang_priority, config,
                                             settings, memory, now)) is not None:
            refused.append(f"{job_id} ({not_movable})")
    if refused:
        return Verdict(Outcome.NO_VICTIMS, "not moved: " + ", ".join(refused))
    used = memory.used(now)
    if used + len(wanted) > settings.max_moves_per_hour:
        return Verdict(Outcome.RATE_LIMITED, f"{used} move(s) in the last hour; {len(wanted)} more would exceed "
                       f"policy.defragmentation.max_moves_per_hour {settings.max_moves_per_hour}", wanted)
    why = rate_limit_verdict(config, gang.queue, queue_recent, now, len(wanted))
    if why is not None:
        return Verdict(Outcome.RATE_LIMITED, why, wanted)
    return Verdict(Outcome.STARTED, f"{len(wanted)} job(s) moved so that {gang.job_id} can start on the GPUs they "
                   "free", wanted)


def memory_of(rows: Iterable[asyncpg.Record]) -> Memory:
    """The bounds' memory from this schema's move protocols of the last hour (RECENT_MOVES)."""
    memory = Memory.empty()
    for r in rows:
        at = float(r["requested_at"])
        memory.move_times.append(at)
        victim = str(r["victim"])
        memory.last_moved[victim] = max(at, memory.last_moved.get(victim, at))
    return memory


async def recent_moves(conn: asyncpg.Connection, config: QueuesConfig, now: float) -> Memory:
    """The moves this service made within the longer of the hour and the job cool-down."""
    since = now - max(HOUR_S, float(config.policy.defragmentation.job_cooldown_s))
    return memory_of(await conn.fetch(RECENT_MOVES, PreemptionReason.DEFRAGMENTATION.value, since))


__all__ = ["RECENT_MOVES", "Verdict", "judge", "memory_of", "recent_moves"]
