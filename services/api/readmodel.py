"""The jobs read model behind `gpuq status`, `gpuq explain` and the API: a join over the services' own tables.

Admission knows every job (pending, admitted, finished, rejected and why); the scheduler knows placements
and placement reasons; the executor knows what runs. The CLI joins them read-only; it never writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

import asyncpg

from services.core.eta.words import eta_words
from services.core.kube.provisioning import words as provisioning_words
from shared.quota_keys import POOL, shown
from shared.timefmt import human_time

STATUS_SQL = """
SELECT a.job_id, a.team, a.queue, a.status AS admission_status, a.reason, a.message, a.position_in_queue,
       a.position_in_cohort, a.eta, a.eta_low, a.eta_high, a.submitted_at, a.admitted_at, a.finished_at,
       a.outcome, a.borrowing, a.spec, a.usage, {sched} , {run}, {prov}
FROM admission.jobs a
{sched_join}
{run_join}
{prov_join}
{where}
ORDER BY a.submitted_at, a.job_id
"""

SCHED_COLS = ("s.status AS sched_status, s.reason AS sched_reason, s.message AS sched_message, s.planned_start, "
              "s.bindings, s.racks_spanned, s.blocks_spanned, s.placed_at")
SCHED_NULL = ("NULL AS sched_status, NULL AS sched_reason, NULL AS sched_message, NULL AS planned_start, "
              "NULL AS bindings, NULL AS racks_spanned, NULL AS blocks_spanned, NULL AS placed_at")
RUN_COLS = "r.status AS run_status, r.nodes AS run_nodes, r.started_at"
RUN_NULL = "NULL AS run_status, NULL AS run_nodes, NULL AS started_at"
# Capacity asked of the cluster-autoscaler for a waiting job (services/executor/kube/provisioning.py).
PROV_COLS = ("CASE WHEN p.job_id IS NULL OR p.state = 'released' THEN NULL ELSE json_build_object('namespace', "
             "p.namespace, 'name', p.name, 'class_name', p.class_name, 'state', p.state, 'reason', p.reason, "
             "'message', p.message, 'retry_at', p.retry_at) END AS provisioning")
PROV_NULL = "NULL AS provisioning"


def derive_state(row: dict[str, Any]) -> str:
    status = row["admission_status"]
    if status == "rejected":
        return "rejected"
    if status == "finished":
        outcome = row.get("outcome") or ""
        return {"Succeeded": "completed", "Cancelled": "cancelled"}.get(outcome, "failed")
    if status == "pending":
        return "pending"
    if row.get("run_status") == "running":
        return "running"
    if row.get("sched_status") == "placed":
        return "placed"
    return "admitted"


async def _exists(conn: asyncpg.Connection, table: str) -> bool:
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table))


async def fetch_status(database_url: str, job_id: str | None, *, limit: int | None = None,
                       team: str | None = None) -> list[dict[str, Any]]:
    """Jobs (one, or all), oldest first; `team`: that team's jobs only (the API's scope for a team's token)."""
    conn = await asyncpg.connect(database_url)
    try:
        if not await _exists(conn, "admission.jobs"):
            return []
        has_sched = await _exists(conn, "scheduler.jobs")
        has_run = await _exists(conn, "executor.runs")
        has_prov = await _exists(conn, "executor.kube_provisioning")
        sql = STATUS_SQL.format(
            sched=SCHED_COLS if has_sched else SCHED_NULL, run=RUN_COLS if has_run else RUN_NULL,
            sched_join="LEFT JOIN scheduler.jobs s USING (job_id)" if has_sched else "",
            run_join="LEFT JOIN executor.runs r USING (job_id)" if has_run else "",
            prov=PROV_COLS if has_prov else PROV_NULL,
            prov_join="LEFT JOIN executor.kube_provisioning p USING (job_id)" if has_prov else "",
            where="WHERE ($1::text IS NULL OR a.job_id = $1) AND ($2::text IS NULL OR a.team = $2)")
        if limit:
            sql += f" LIMIT {int(limit)}"
        rows = await conn.fetch(sql, job_id, team)
    finally:
        await conn.close()
    out = []
    for r in rows:
        d = dict(r)
        d["state"] = derive_state(d)
        bindings = json.loads(d["bindings"]) if d.get("bindings") else []
        d["nodes"] = sorted({b["node"] for b in bindings}, key=_natural)
        d["spec"] = json.loads(d["spec"]) if isinstance(d["spec"], str) else d["spec"]
        if isinstance(d.get("usage"), str):
            d["usage"] = json.loads(d["usage"])
        if isinstance(d.get("provisioning"), str):
            d["provisioning"] = json.loads(d["provisioning"])
        out.append(d)
    return out


def _natural(name: str) -> tuple[object, ...]:
    """h100-2 before h100-10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def fmt_time(ts: float | None) -> str:
    """A time as every server-produced text writes it: date, time to the second, zone (shared/timefmt.py)."""
    if ts is None:
        return "-"
    return human_time(ts)


# States in which a job has not started running yet: its wait goes on. Admitted is not running (issue 51: the
# wait froze at admission), nor is placed (the executor has not reported the start yet).
WAITING_STATES = frozenset({"pending", "admitted", "placed"})


def wait_seconds(row: dict[str, Any], now: float) -> float | None:
    """How long the job has waited to run: until `now` while it has not started (pending, admitted, placed), until
    its run's start once it runs or ran (the placement time when no start was reported), until its end for one
    that ended without running. `submitted_at` is the first submission (kept across requeues), so a preempted job
    waiting again counts from there, as its queue position does. None when nothing says."""
    submitted = row.get("submitted_at")
    if submitted is None:
        return None
    state = row["state"]
    if state in WAITING_STATES:
        return max(0.0, now - submitted)
    started = row.get("started_at") or row.get("placed_at")
    end = started if started is not None else row.get("finished_at")
    return max(0.0, end - submitted) if end is not None else None


def eta_view(row: dict[str, Any], now: float) -> dict[str, Any]:
    """The ETA as a reader may be shown it at `now`: never in the past. The ETA is admission's (its service owns
    the estimate and refreshes it on its own schedule, sooner once one has passed); a stored ETA that has passed
    while the job still waits is stale, so it is shown as `now` with `eta_overdue` true and the time that was
    expected in `eta_expected` (the next refresh gives a new value). The p10-p90 range is clamped alike."""
    eta, low, high = row.get("eta"), row.get("eta_low"), row.get("eta_high")
    if eta is None or row.get("state") not in WAITING_STATES:
        return {"eta": eta, "eta_low": low, "eta_high": high, "eta_overdue": False, "eta_expected": None}
    if eta >= now:  # (the start ahead, its range's low end may have passed: the start cannot be earlier than now)
        return {"eta": eta, "eta_low": None if low is None else max(low, now), "eta_high": high,
                "eta_overdue": False, "eta_expected": None}
    return {"eta": now, "eta_low": None if low is None else max(low, now),
            "eta_high": None if high is None else max(high, now), "eta_overdue": True, "eta_expected": eta}


def explain_lines(row: dict[str, Any], now: float) -> list[str]:
    """Why, where and when, in words, for one job."""
    state = row["state"]
    lines = [f"job {row['job_id']} (team {row['team']}, queue {row['queue']}): {state}"]
    spec = row["spec"]
    gpus = sum(p["count"] * p["gpus_per_pod"] for p in spec["pod_sets"] if not p.get("mig_profile"))
    lines.append(f"  asks for {gpus} GPU(s) in {sum(p['count'] for p in spec['pod_sets'])} pod(s), "
                 f"priority class {spec['priority_class']}, limit {spec['max_runtime_s']} s")
    lines.append(f"  submitted {fmt_time(row['submitted_at'])}")
    if state == "rejected":
        lines.append(f"  rejected: {row['reason']}: {row['message']}")
    elif state == "pending":
        lines.append(f"  waiting for admission: {row['reason'] or 'not yet evaluated'}"
                     + (f": {row['message']}" if row.get("message") else ""))
        if row.get("position_in_queue"):
            lines.append(f"  position {row['position_in_queue']} in queue {row['queue']}, "
                         f"{row['position_in_cohort']} in its cohort")
        lines.append(f"  waited {now - row['submitted_at']:.0f} s so far; expected start {eta_text(row, now)}")
    elif state == "admitted":
        lines.append(f"  admitted {fmt_time(row['admitted_at'])}" + (" (borrowing)" if row.get("borrowing") else ""))
        lines.append(f"  waiting for placement: {row.get('sched_reason') or 'next cycle'}"
                     + (f": {row['sched_message']}" if row.get("sched_message") else ""))
        if row.get("planned_start"):
            lines.append(f"  reserved to start at {fmt_time(max(row['planned_start'], now))}")
        if row.get("eta"):  # admission's ETA counts what the reservation does not: preemptions, protection windows
            lines.append(f"  expected start {eta_text(row, now)}")
        wait = wait_seconds(row, now)
        if wait is not None:
            lines.append(f"  waited {wait:.0f} s so far")
    else:
        if row.get("placed_at"):
            lines.append(f"  placed {fmt_time(row['placed_at'])} on {', '.join(row['nodes'])} "
                         f"({row.get('racks_spanned')} rack(s), {row.get('blocks_spanned')} block(s))")
        if state in ("completed", "failed", "cancelled"):
            lines.append(f"  finished {fmt_time(row['finished_at'])}: {row.get('outcome')}")
    if row.get("usage") and state in ("admitted", "placed", "running"):
        lines.append(charged_words(row["usage"]))
    if row.get("provisioning") and state in ("pending", "admitted"):
        lines.append("  " + provisioning_words(row["provisioning"]))
    if row.get("borrowing") and state in ("admitted", "placed", "running"):
        lines.append(borrowing_risk(spec))
    return lines


def charged_words(usage: dict[str, int]) -> str:
    """The quota admission charged, and the node pool it gave the job (docs/admission.md, "Node pools as
    flavors") or the job selected, where its queue sets that pool's `pool/<name>` quota."""
    pools = sorted(k.removeprefix(POOL) for k in usage if k.startswith(POOL))
    return (f"  quota charged: {', '.join(shown(k, v) for k, v in sorted(usage.items()))}"
            + (f"; on node pool {', '.join(pools)}" if pools else ""))


def borrowing_risk(spec: dict[str, Any]) -> str:
    """The risk a borrower takes: its lender gets its quota back when it needs it (reclaim always succeeds, after
    the protection window and the checkpoint grace), so what a reclaim would cost this job is worth saying."""
    if (spec.get("checkpoint") or {}).get("supported"):
        return ("  borrows quota: its lender may reclaim it; the job checkpoints first, so a reclaim loses little "
                "and it resumes from the checkpoint")
    return (f"  borrows quota: its lender may reclaim it, and the job cannot checkpoint, so a reclaim would lose "
            f"all its work so far (up to its {spec['max_runtime_s']} s limit)")


def eta_text(row: dict[str, Any], now: float | None = None) -> str:
    """The expected start in words: most likely, then the p10-p90 range when admission gave one. With `now`, an
    ETA that has passed is not shown in the past (`eta_view`): it says so, and that it is being recomputed."""
    if now is not None:
        view = eta_view(row, now)
        if view["eta_overdue"]:
            return (f"overdue: it was expected by {fmt_time(view['eta_expected'])}; any time now "
                    "(the estimate is being recomputed)")
        row = {**row, **view}
    # the words the Pending Event on a Kubernetes workload says too (services/core/eta/words.py)
    return eta_words(row.get("eta") or None, row.get("eta_low"), row.get("eta_high"))


def public(row: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """A job as the API returns it. With `now` (the platform's clock), its wait so far (`wait_s`, `wait_seconds`)
    and its ETA as of then (`eta_view`: never in the past; `eta_overdue` says a passed one was clamped)."""
    keep = ("job_id", "team", "queue", "state", "reason", "message", "position_in_queue", "position_in_cohort",
            "eta", "eta_low", "eta_high", "submitted_at", "admitted_at", "placed_at", "finished_at", "outcome", "nodes",
            "sched_reason", "sched_message", "planned_start", "started_at")
    gpus = sum(p["count"] * p["gpus_per_pod"] for p in row["spec"]["pod_sets"]) if row.get("spec") else None
    out = {**{k: row.get(k) for k in keep}, "gpus": gpus}
    if now is not None:
        out.update(eta_view(row, now), wait_s=wait_seconds(row, now))
    return out
