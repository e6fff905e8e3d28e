"""Each loader on small slices of the real trace files (tests/data/traces, sliced further into tmp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import ClusterConfig, NodeGroup
from sim.loaders import (
    OPENB_SLICE_PROFILE,
    PHILLY_DEFAULT_QUEUE,
    TraceError,
    Window,
    gang_shape,
    load_generic_csv,
    load_openb,
    load_philly,
    month_window,
)
from sim.run import TraceOptions, detect_format, load_trace
from sim.synth import RUNTIME_BUCKETS_S, estimate_runtime, priority_class


def _slice(src: Path, dst: Path, rows: int, extra: list[str] | None = None) -> Path:
    with src.open() as fh:
        lines = [next(fh) for _ in range(rows + 1)]
    dst.write_text("".join(lines) + "".join(extra or []))
    return dst


def test_gang_shape():
    assert gang_shape(1, 8) == (1, 1)
    assert gang_shape(8, 8) == (1, 8)
    assert gang_shape(16, 8) == (2, 8)
    assert gang_shape(12, 8) == (2, 6)
    assert gang_shape(24, 8) == (3, 8)
    assert gang_shape(128, 8) == (16, 8)


def test_synthesised_estimates_and_classes_are_seeded_per_job():
    a = [estimate_runtime(1000, f"j{i}", 7) for i in range(200)]
    assert a == [estimate_runtime(1000, f"j{i}", 7) for i in range(200)]
    assert a != [estimate_runtime(1000, f"j{i}", 8) for i in range(200)]
    assert all(x in RUNTIME_BUCKETS_S for x in a)
    assert any(x < 1000 for x in a) and any(x > 1000 for x in a)  # users both under- and over-estimate
    classes = [priority_class(f"j{i}", 0) for i in range(2000)]
    assert {"high", "normal", "low"} == set(classes)
    assert 0.7 < classes.count("normal") / 2000 < 0.9


def test_philly_slice(traces_dir, tmp_path):
    # 300 real rows plus an exact duplicate of row 1, a row of an unlisted VC and a blank line.
    with (traces_dir / "philly.csv").open() as fh:
        fh.readline()
        first = fh.readline()
    extra = [first, "2017-10-05 10:00:00,120.0,16,1920.0,925e2b\n", "\n"]
    path = _slice(traces_dir / "philly.csv", tmp_path / "philly.csv", 300, extra)
    tr = load_philly(path, vc_path=traces_dir / "philly_vc.csv", seed=1)
    assert tr.info["duplicates_dropped"] == 1 and tr.info["blank_rows"] == 1
    assert len(tr.jobs) == 301
    submits = [j.submit_time for j in tr.jobs]
    assert submits == sorted(submits) and submits[0] == 0
    assert tr.capacity_gpus == 2816 and all(n.gpus == 8 for n in tr.nodes)
    qmap = tr.queues.queue_map
    assert qmap["6214e9"].quotas["philly-gpu"].nominal == 64 * 8
    assert qmap[PHILLY_DEFAULT_QUEUE].quotas["philly-gpu"].nominal == 0
    assert "925e2b" in qmap[PHILLY_DEFAULT_QUEUE].teams
    odd = next(j for j in tr.jobs if j.team == "925e2b")
    assert odd.queue == PHILLY_DEFAULT_QUEUE and (odd.pods, odd.gpus_per_pod) == (2, 8)
    assert odd.preferred_level == "rack"
    assert all(j.team == j.queue for j in tr.jobs if j.team in qmap)


def test_philly_month_window_and_load_scaling(traces_dir, tmp_path):
    path = _slice(traces_dir / "philly.csv", tmp_path / "philly.csv", 2000)
    (tmp_path / "philly_vc.csv").write_text((traces_dir / "philly_vc.csv").read_text())
    w = month_window("2017-10")
    tr = load_philly(path, window=w)
    assert tr.jobs and tr.epoch0 >= w.start and all(tr.epoch0 + j.submit_time < w.end for j in tr.jobs)
    full = load_trace(TraceOptions(trace=path, month="2017-10"))
    scaled = load_trace(TraceOptions(trace=path, month="2017-10", load=0.9))
    assert scaled.offered_load() == pytest.approx(0.9, rel=0.15)
    assert scaled.capacity_gpus < full.capacity_gpus
    # every VC keeps at least one node and the guarantees still sum to the cluster
    total = sum(q.quotas["philly-gpu"].nominal for q in scaled.queues.queues)
    assert total == scaled.capacity_gpus


def test_openb_slice(traces_dir, tmp_path):
    path = _slice(traces_dir / "openb_pod_list_gpuspec33.csv", tmp_path / "pods.csv", 400)
    tr = load_openb(path, nodes_path=traces_dir / "openb_node_list_gpu_node.csv",
                    topology_path=traces_dir / "lingjun_topo.csv")
    assert tr.info["cpu_only_dropped"] > 0
    assert len(tr.nodes) == 1213 and tr.capacity_gpus > 0
    frac = [j for j in tr.jobs if j.mig_profile]
    assert frac and all(j.mig_profile == OPENB_SLICE_PROFILE and j.pods == 1 for j in frac)
    shared = [n for n in tr.nodes if n.mig is not None]
    assert shared and all(n.mig.slices_per_gpu == 2 for n in shared)
    assert {j.priority_class for j in tr.jobs} <= {"high", "normal", "low"}
    multi = [j for j in tr.jobs if len(j.gpu_models) > 1]
    assert multi and all(list(j.gpu_models) == sorted(j.gpu_models) for j in multi)
    # the first 847 nodes take the Clos topology: rack = PSW/ASW, block = PSW
    assert tr.nodes[0].rack.count("/") == 1 and tr.nodes[0].rack.startswith(tr.nodes[0].block)
    quotas = tr.queues.queues[0].quotas
    assert {k for k in quotas if ":" not in k} == {n.gpu_model for n in tr.nodes if n.mig is None}
    assert {k for k in quotas if ":" in k} == {f"{n.gpu_model}:{OPENB_SLICE_PROFILE}" for n in shared}
    assert sum(v.nominal for k, v in quotas.items() if ":" in k) == sum(n.gpus * 2 for n in shared)
    assert all(j.duration >= 1 for j in tr.jobs)


def test_generic_csv(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_time,duration,gpus,team,priority_class,gpu_model,max_runtime_s\n"
                    "b,20,50,16,team-b,,,\n"
                    "a,10,100,2,team-a,high,H100|A100,3600\n")
    cluster = ClusterConfig(node_groups=(NodeGroup(name="h", count=4, gpus_per_node=8, gpu_model="H100",
                                                   cpu_milli=1, memory_mib=1),))
    tr = load_generic_csv(path, cluster.nodes(), None, window=Window(start=0))
    assert [j.job_id for j in tr.jobs] == ["a", "b"] and tr.jobs[0].submit_time == 0
    a, b = tr.jobs
    assert a.priority_class == "high" and a.max_runtime_s == 3600 and a.gpu_models == ("H100", "A100")
    assert (b.pods, b.gpus_per_pod) == (2, 8) and b.max_runtime_s in RUNTIME_BUCKETS_S
    assert {q.name for q in tr.queues.queues} == {"team-a", "team-b"}
    assert sum(q.quotas["H100"].nominal for q in tr.queues.queues) == 32
    assert detect_format(path) == "generic"


def test_generic_csv_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("job_id,submit_time,duration,gpus,team\na,0,10,x,t\n")
    with pytest.raises(TraceError, match="line 2"):
        load_generic_csv(path, [], None)
    path.write_text("job_id,submit_time\n")
    with pytest.raises(TraceError, match="missing column"):
        load_generic_csv(path, [], None)
