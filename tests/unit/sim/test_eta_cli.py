"""ETA by forward simulation with the production cores, and the `gpuq simulate` command end to end."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cli.main import app
from services.core.admission import AdmissionState, Workload, admission_cycle
from services.core.eta import estimate_starts
from services.core.scheduler import ClusterState, PendingJob, RunningJob, schedule_cycle
from shared.config import load_queues
from sim.loaders import queues_for_teams

from .conftest import job, nodes

REQUIRED = ("policy", "jobs", "completed", "avg_jct_s", "p50_wait_s", "p99_wait_s", "gpu_utilization",
            "busy_gpu_utilization", "makespan_s", "delivered_gpu_hours", "preemptions", "lost_gpu_hours",
            "idle_partial_gang_gpu_hours", "jain_fairness", "per_team", "per_priority_class", "sim_wall_s")


def _state_with(running: list, pending: list, now: float):
    """Submit `running` at t=0 and run them (admission + placement), then submit `pending`."""
    cluster = ClusterState.from_nodes(nodes(1))
    adm = AdmissionState(queues_for_teams(["a"], {"gpu": 8}))
    for j in running:
        assert adm.submit(Workload(spec=j.spec(), submitted_at=0.0)) is None
    decision = admission_cycle(adm, 0.0, capacity=cluster.free_gpus_by_model())
    result = schedule_cycle(cluster, [PendingJob(spec=a.spec) for a in decision.admitted], [], 0.0)
    assert len(result.placed) == len(running)
    for j in pending:
        assert adm.submit(Workload(spec=j.spec(), submitted_at=now)) is None
    return cluster, adm


def test_eta_is_when_the_blocking_job_is_expected_to_end():
    running = [job("r1", 0, 10, gpus_per_pod=6, estimate=3600)]
    pending = [job("p1", 5, 10, gpus_per_pod=8, estimate=600), job("p2", 5, 10, gpus_per_pod=8, estimate=600)]
    cluster, adm = _state_with(running, pending, now=5.0)
    before = (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted))
    etas = estimate_starts(cluster, adm, {"r1": 3600.0}, now=5.0)
    # p1 waits for r1's expected end; p2 follows p1 (its own estimate of 600 s).
    assert etas == {"p1": 3600.0, "p2": 4200.0}
    assert (dict(cluster.allocations()), dict(adm.pending), dict(adm.admitted)) == before  # pure


def test_eta_starts_now_when_it_fits():
    running = [job("r1", 0, 10, gpus_per_pod=4, estimate=3600)]
    cluster, adm = _state_with(running, [job("p1", 5, 10, gpus_per_pod=2)], now=5.0)
    assert estimate_starts(cluster, adm, {"r1": 3600.0}, now=5.0) == {"p1": 5.0}


def test_running_job_list_shape():
    # The engine hands the scheduler its running jobs by expected end; a sanity check of the contract used.
    assert RunningJob(job_id="x", expected_end=1.0).expected_end == 1.0


def test_simulate_command_writes_json_and_report(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["job_id,submit_time,duration,gpus,team"]
    rows += [f"j{i},{i * 30},{200 + 37 * (i % 5)},{(1, 2, 4, 8, 16)[i % 5]},team-{'ab'[i % 2]}" for i in range(40)]
    trace.write_text("\n".join(rows) + "\n")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("node_groups:\n  - {name: h, count: 4, gpus_per_node: 8, gpu_model: H100, cpu_milli: 96000,"
                       " memory_mib: 1048576}\n")
    queues = tmp_path / "queues.yaml"
    queues.write_text(
        "priority_classes: [{name: normal, value: 100}, {name: high, value: 500}, {name: low, value: 0}]\n"
        "cohorts: [{name: c}]\n"
        "queues:\n"
        "  - {name: team-a, cohort: c, quotas: {H100: {nominal: 16}}}\n"
        "  - {name: team-b, cohort: c, quotas: {H100: {nominal: 16}}}\n")
    out, report = tmp_path / "out.json", tmp_path / "report"
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--cluster", str(cluster), "--queues",
                                   str(queues), "--policy", "gpuq,quota-fifo,pod-fifo", "--json", str(out),
                                   "--report", str(report), "--write-queues", str(tmp_path / "used.yaml")])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["results"]] == ["gpuq", "quota-fifo", "pod-fifo"]
    for r in doc["results"]:
        assert all(k in r for k in REQUIRED)
        assert r["completed"] == 40
        assert set(r["per_team"]) == {"team-a", "team-b"}
        assert r["per_team"]["team-a"]["quota_share"] == 0.5
    for name in ("report.md", "utilisation.png", "wait_cdf.png", "team_shares.png"):
        assert (report / name).stat().st_size > 0
    # what-if: move 8 GPUs of quota from team-a to team-b and replay with the edited queues.yaml
    used = load_queues(tmp_path / "used.yaml")
    assert used == load_queues(queues)
    moved = queues.read_text().replace("team-a, cohort: c, quotas: {H100: {nominal: 16}}",
                                       "team-a, cohort: c, quotas: {H100: {nominal: 8}}")
    moved = moved.replace("team-b, cohort: c, quotas: {H100: {nominal: 16}}",
                          "team-b, cohort: c, quotas: {H100: {nominal: 24}}")
    (tmp_path / "moved.yaml").write_text(moved)
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--cluster", str(cluster), "--queues",
                                   str(tmp_path / "moved.yaml"), "--policy", "quota-fifo", "--json", str(out)])
    assert res.exit_code == 0, res.output
    team = json.loads(out.read_text())["results"][0]["per_team"]
    assert (team["team-a"]["quota_share"], team["team-b"]["quota_share"]) == (0.25, 0.75)


def test_simulate_rejects_an_unknown_policy(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("job_id,submit_time,duration,gpus,team\na,0,1,1,x\n")
    res = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--policy", "yarn-fifo"])
    assert res.exit_code == 2
    assert "unknown policy" in res.output
