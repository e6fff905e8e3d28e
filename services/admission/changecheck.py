"""Reading what a proposed queue configuration is checked against (services/core/admission/configcheck.py): the
version in force, the live cluster (the nodes the executors announced, from the scheduler's read model) and the
jobs each queue holds (admission's read model). Admission, `gpuq apply-queues --dry-run` (admin mode) and the API
read the same facts through this module, so the CLI's dry run says what admission will decide.

This module imports nothing of admission's shell: any service may use it.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.admission import configmodel
from services.admission.readmodel import JOBS_VIEW, Conn
from services.admission.readmodel import published as jobs_published
from services.core.admission.configcheck import ConfigCheck, QueueJobs, check_change, inventory_of
from services.scheduler import readmodel as cluster
from shared.config import QueuesConfig


async def queue_jobs(conn: Conn) -> dict[str, QueueJobs]:
    """Pending and admitted jobs per queue, as committed (none before admission's first start)."""
    if not await jobs_published(conn):
        return {}
    rows = await conn.fetch(f"SELECT queue, count(*) FILTER (WHERE status = 'pending') AS pending, "
                            f"count(*) FILTER (WHERE status = 'admitted') AS admitted FROM {JOBS_VIEW} "
                            "WHERE status IN ('pending', 'admitted') GROUP BY queue")
    return {r["queue"]: QueueJobs(pending=r["pending"], admitted=r["admitted"]) for r in rows}


async def check_proposal(conn: Conn, config: QueuesConfig, *,
                         held: Mapping[str, QueueJobs] | None = None) -> ConfigCheck:
    """`config` checked against the version in force and the live cluster. `held`: jobs per queue the caller knows
    of that may not be committed yet (admission's memory), counted where it knows more than the table."""
    current = await configmodel.in_force(conn)
    jobs = await queue_jobs(conn)
    for queue, mine in (held or {}).items():
        there = jobs.get(queue, QueueJobs())
        jobs[queue] = QueueJobs(pending=max(there.pending, mine.pending), admitted=max(there.admitted, mine.admitted))
    nodes = await cluster.nodes(conn)
    return check_change(current.config if current is not None else None, config, inventory_of(nodes), jobs)
