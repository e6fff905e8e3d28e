"""Trace loaders: the generic CSV, Microsoft Philly and the Alibaba openb pod list.

Every loader returns a `Trace` with jobs sorted by (submit_time, job_id) and times relative to the first
submission in the window. Missing estimates and priorities are synthesised by `sim.synth` (seeded per job).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from shared.config import (
    ClusterConfig,
    Cohort,
    FlavorQuota,
    NodeGroup,
    PriorityClass,
    QueueConfig,
    QueuesConfig,
    apply_topology,
    load_topology_csv,
)
from shared.domain import GpuSharing, MigLayout, NodeSpec, SharingMode, TopologyLevel
from sim.model import Trace, TraceJob
from sim.synth import checkpoint_interval, estimate_runtime, priority_class

DEFAULT_PRIORITY_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass(name="production", value=1000, preemptible=False),
    PriorityClass(name="high", value=500, preemptible=False),
    PriorityClass(name="normal", value=100, preemptible=True),
    PriorityClass(name="low", value=0, preemptible=True),
)

PHILLY_GPU_MODEL = "philly-gpu"
PHILLY_GPUS_PER_NODE = 8
PHILLY_DEFAULT_QUEUE = "default"


class TraceError(ValueError):
    """A trace file is unreadable or malformed; the message names the file and the row."""


@dataclass(frozen=True)
class Window:
    """Submissions kept: start <= submit < end, in the trace's own clock (epoch seconds or trace seconds)."""

    start: float | None = None
    end: float | None = None

    def keeps(self, t: float) -> bool:
        return (self.start is None or t >= self.start) and (self.end is None or t < self.end)


def month_window(month: str) -> Window:
    """`2017-10` -> [2017-10-01, 2017-11-01) in UTC epoch seconds."""
    try:
        year, mon = (int(x) for x in month.split("-"))
        start = datetime(year, mon, 1, tzinfo=UTC)
        end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=UTC)
    except ValueError as exc:
        raise TraceError(f"--month expects YYYY-MM, got {month!r}") from exc
    return Window(start.timestamp(), end.timestamp())


def parse_time(value: str) -> float:
    """Seconds (`3600`) or an ISO date/time (`2017-10-01`, `2017-10-01T12:00:00`, naive = UTC)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError as exc:
        raise TraceError(f"expected seconds or an ISO date, got {value!r}") from exc
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def gang_shape(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(pods, gpus_per_pod) for a gang of `gpus`: one pod when it fits a node, else the fewest equal pods
    that each fit a node (16 -> 2×8, 12 -> 2×6, 24 -> 3×8); 1-GPU pods as a last resort."""
    if gpus <= gpus_per_node:
        return 1, max(gpus, 0)
    for pods in range(math.ceil(gpus / gpus_per_node), gpus + 1):
        if gpus % pods == 0 and gpus // pods <= gpus_per_node:
            return pods, gpus // pods
    return gpus, 1


def _topology_for(pods: int) -> TopologyLevel | None:
    # Multi-node gangs ask to stay in one rack if possible (what NCCL users want); policies without
    # topology awareness ignore it.
    return TopologyLevel.RACK if pods > 1 else None


def _rebase(jobs: list[TraceJob]) -> tuple[list[TraceJob], int]:
    jobs.sort(key=lambda j: (j.submit_time, j.job_id))
    if not jobs:
        return jobs, 0
    t0 = jobs[0].submit_time
    return [replace(j, submit_time=j.submit_time - t0) for j in jobs], t0


# --------------------------------------------------------------------------- generic CSV

GENERIC_COLUMNS = ("job_id", "submit_time", "duration", "gpus", "team")


def load_generic_csv(path: Path, nodes: Sequence[NodeSpec], queues: QueuesConfig | None, *,
                     window: Window = Window(), seed: int = 0) -> Trace:
    """`job_id,submit_time,duration,gpus,team[,priority_class,gpu_model,max_runtime_s]` (seconds), and the columns
    an exported trace adds (sim/export.py: `queue,pods,gpus_per_pod,mig_profile,checkpoint_interval_s`).
    `team` doubles as the queue unless `queue` names one; `gpu_model` is an any-of list separated by `|`; `pods`
    and `gpus_per_pod` give the gang's shape (else whole nodes of `gpus`); `checkpoint_interval_s` empty: the job
    cannot checkpoint (the column absent: synthesised). Without `queues`, each queue gets an equal share of every
    GPU model, all in one cohort (so idle quota is borrowable)."""
    per_node = max((n.gpus for n in nodes), default=PHILLY_GPUS_PER_NODE) or PHILLY_GPUS_PER_NODE
    jobs: list[TraceJob] = []
    with _open(path) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in GENERIC_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; expected "
                             "job_id,submit_time,duration,gpus,team[,priority_class,gpu_model,max_runtime_s]")
        for lineno, row in enumerate(reader, start=2):
            try:
                submit = float(row["submit_time"])
                if not window.keeps(submit):
                    continue
                gpus = int(float(row["gpus"]))
                duration = max(1, round(float(row["duration"])))
                job_id = row["job_id"].strip()
                team = row["team"].strip().lower()
                models = tuple(m for m in (row.get("gpu_model") or "").split("|") if m)
                est = row.get("max_runtime_s") or ""
                pods, per_pod = gang_shape(gpus, per_node)
                if row.get("pods"):  # an exported trace (sim/export.py) says the shape
                    pods, per_pod = int(row["pods"]), int(row.get("gpus_per_pod") or 1)
                mig = (row.get("mig_profile") or "").strip() or None
                # the column given: its value (empty: the job cannot checkpoint); absent: synthesised
                ckpt = (checkpoint_interval(job_id, seed) if "checkpoint_interval_s" not in row
                        else int(float(row["checkpoint_interval_s"])) if row["checkpoint_interval_s"] else None)
                jobs.append(TraceJob(
                    job_id=job_id, submit_time=round(submit), duration=duration, team=team,
                    queue=(row.get("queue") or "").strip() or team,
                    pods=pods, gpus_per_pod=per_pod, mig_profile=mig, gpu_models=models,
                    priority_class=(row.get("priority_class") or "").strip() or priority_class(job_id, seed),
                    max_runtime_s=int(float(est)) if est else estimate_runtime(duration, job_id, seed),
                    checkpoint_interval_s=ckpt,
                    preferred_level=_topology_for(pods),
                ))
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{path}: line {lineno}: {exc}") from None
    jobs, t0 = _rebase(jobs)
    if queues is None:
        queues = queues_for_teams(sorted({j.queue for j in jobs}), _capacity_by_model(nodes),
                                  extra_teams=_teams_of_queues(jobs))
    return Trace(name=path.stem, jobs=jobs, nodes=list(nodes), queues=queues, epoch0=float(t0),
                 info={"format": "generic", "rows_kept": len(jobs)})


def _teams_of_queues(jobs: Sequence[TraceJob]) -> dict[str, list[str]] | None:
    """queue -> the teams submitting to it, where a queue is not just its team's (None: every queue is)."""
    teams: dict[str, set[str]] = {}
    for j in jobs:
        teams.setdefault(j.queue, set()).add(j.team)
    if all(t == {q} for q, t in teams.items()):
        return None
    return {q: sorted(t | {q}) for q, t in sorted(teams.items())}


def queues_for_teams(teams: Sequence[str], capacity: Mapping[str, int], *,
                     nominal: Mapping[str, int] | None = None, cohort: str = "all",
                     extra_teams: Mapping[str, Sequence[str]] | None = None) -> QueuesConfig:
    """One queue per team in one cohort. `nominal` (team -> GPUs of every model) or equal shares (the
    remainder goes to the first teams, so guarantees sum exactly to capacity)."""
    queues = []
    for i, team in enumerate(teams):
        quotas = {}
        for model, cap in sorted(capacity.items()):
            if nominal is not None:
                share = nominal.get(team, 0)
            else:
                share = cap // len(teams) + (1 if i < cap % len(teams) else 0)
            quotas[model] = FlavorQuota(nominal=share)
        members = tuple((extra_teams or {}).get(team, (team,)))
        queues.append(QueueConfig(name=team, cohort=cohort, teams=members, quotas=quotas))
    return QueuesConfig(priority_classes=DEFAULT_PRIORITY_CLASSES, cohorts=(Cohort(name=cohort),),
                        queues=tuple(queues), default_priority_class="normal")


def _capacity_by_model(nodes: Sequence[NodeSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in nodes:
        out[n.gpu_model] = out.get(n.gpu_model, 0) + n.gpus
    return dict(sorted(out.items()))


def _open(path: Path) -> TextIO:
    try:
        return path.open(newline="")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from exc


# --------------------------------------------------------------------------- Philly


# The last Philly window read (the file's identity, window, seed, VCs -> its jobs): `--load` reads the trace at up to
# four cluster scales, and the jobs do not depend on the scale.
_PHILLY_READ: dict[tuple[object, ...], tuple[list[TraceJob], int, int, int]] = {}


def _philly_jobs(path: Path, window: Window, seed: int, vc_nodes: frozenset[str]
                 ) -> tuple[list[TraceJob], int, int, int]:
    """The window's jobs (rebased to its first submission), its first submission time, and how many duplicate and
    blank rows were dropped. Remembered for the last file read while it is unchanged (a copy of the list)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from exc
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, window.start, window.end, seed, vc_nodes)
    hit = _PHILLY_READ.get(key)
    if hit is None:
        hit = _read_philly_jobs(path, window, seed, vc_nodes)
        _PHILLY_READ.clear()
        _PHILLY_READ[key] = hit
    jobs, t0, duplicates, blank = hit
    return list(jobs), t0, duplicates, blank


def _read_philly_jobs(path: Path, window: Window, seed: int, vc_nodes: frozenset[str]
                      ) -> tuple[list[TraceJob], int, int, int]:
    seen: set[tuple[str, ...]] = set()
    rows: list[tuple[float, int, int, str, int]] = []  # (epoch, duration, gpus, vc, line)
    duplicates = blank = 0
    with _open(path) as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or header[:3] != ["timestamp", "duration", "num_gpus"]:
            raise TraceError(f"{path}: expected header timestamp,duration,num_gpus,gpu_time,cluster")
        for lineno, row in enumerate(reader, start=2):
            if not row or not any(row):
                blank += 1
                continue
            key = tuple(row)
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            try:
                ts = datetime.fromisoformat(row[0]).replace(tzinfo=UTC).timestamp()
                rows.append((ts, max(1, round(float(row[1]))), int(row[2]), row[4].strip().lower(), lineno))
            except (IndexError, ValueError) as exc:
                raise TraceError(f"{path}: line {lineno}: {exc}") from None
    rows.sort()
    jobs: list[TraceJob] = []
    for ts, duration, gpus, vc, lineno in rows:
        if not window.keeps(ts):
            continue
        queue = vc if vc in vc_nodes else PHILLY_DEFAULT_QUEUE
        job_id = f"philly-{lineno}"
        pods, per_pod = gang_shape(gpus, PHILLY_GPUS_PER_NODE)
        jobs.append(TraceJob(
            job_id=job_id, submit_time=round(ts), duration=duration, team=vc, queue=queue, pods=pods,
            gpus_per_pod=per_pod, gpu_models=(PHILLY_GPU_MODEL,), priority_class=priority_class(job_id, seed),
            max_runtime_s=estimate_runtime(duration, job_id, seed), preferred_level=_topology_for(pods),
            checkpoint_interval_s=checkpoint_interval(job_id, seed),
        ))
    jobs, t0 = _rebase(jobs)
    return jobs, t0, duplicates, blank


def load_philly(path: Path, *, vc_path: Path | None = None, window: Window = Window(), seed: int = 0,
                cluster_scale: float = 1.0, nodes_per_rack: int = 8, racks_per_block: int = 8) -> Trace:
    """Philly `timestamp,duration,num_gpus,gpu_time,cluster`. Rows sorted by submit time, exact duplicate
    rows dropped, team = VC. Quotas: `philly_vc.csv` node count × 8 GPUs (× cluster_scale, rounded, at least
    one node per VC); VCs not listed share the `default` queue (nominal 0: it lives on borrowed capacity).
    The cluster is the sum of the quotas in 8-GPU nodes."""
    vc_path = vc_path or path.with_name("philly_vc.csv")
    vc_nodes = _read_vc_nodes(vc_path)
    vcs = sorted(vc_nodes)
    scaled = {vc: max(1, round(n * cluster_scale)) for vc, n in vc_nodes.items()}
    jobs, t0, duplicates, blank = _philly_jobs(path, window, seed, frozenset(vc_nodes))
    node_count = sum(scaled.values())
    cluster = ClusterConfig(node_groups=(NodeGroup(
        name="philly", count=node_count, gpus_per_node=PHILLY_GPUS_PER_NODE, gpu_model=PHILLY_GPU_MODEL,
        cpu_milli=96_000, memory_mib=1_048_576, nodes_per_rack=nodes_per_rack, racks_per_block=racks_per_block,
    ),))
    tiny = sorted({j.team for j in jobs if j.queue == PHILLY_DEFAULT_QUEUE})
    nominal = {vc: scaled[vc] * PHILLY_GPUS_PER_NODE for vc in vcs}
    nominal[PHILLY_DEFAULT_QUEUE] = 0
    queues = queues_for_teams([*vcs, PHILLY_DEFAULT_QUEUE], {PHILLY_GPU_MODEL: node_count * 8},
                              nominal=nominal, cohort="philly",
                              extra_teams={PHILLY_DEFAULT_QUEUE: tiny or (PHILLY_DEFAULT_QUEUE,)})
    info: dict[str, object] = {"format": "philly", "duplicates_dropped": duplicates, "blank_rows": blank,
                               "rows_kept": len(jobs), "cluster_scale": cluster_scale,
                               "default_queue_teams": tiny}
    return Trace(name=path.stem, jobs=jobs, nodes=cluster.nodes(), queues=queues, epoch0=float(t0), info=info)


def _read_vc_nodes(path: Path) -> dict[str, int]:
    with _open(path) as fh:
        reader = csv.DictReader(fh)
        if not {"vc", "node num"} <= set(reader.fieldnames or []):
            raise TraceError(f"{path}: expected header vc,node num")
        out: dict[str, int] = {}
        for lineno, row in enumerate(reader, start=2):
            try:
                out[row["vc"].strip().lower()] = int(row["node num"])
            except ValueError as exc:
                raise TraceError(f"{path}: line {lineno}: {exc}") from None
    return out


# --------------------------------------------------------------------------- Alibaba openb

OPENB_QUEUE = "openb"
OPENB_SLICE_PROFILE = "half"  # one half of a GPU: what a fractional pod takes on a shared node
OPENB_SLICES_PER_GPU = 2
QOS_PRIORITY = {"LS": "high", "Guaranteed": "high", "Burstable": "normal", "BE": "low"}


OPENB_SHARING = ("round", "time-slicing", "mps")


def _openb_jobs(pods_path: Path, window: Window, seed: int, fractions: bool) -> tuple[list[TraceJob], int]:
    """openb's GPU pods as jobs (load_openb says how each maps), and how many CPU-only pods were dropped."""
    jobs: list[TraceJob] = []
    cpu_only = 0
    with _open(pods_path) as fh:
        reader = csv.DictReader(fh)
        need = {"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos",
                "creation_time", "deletion_time", "scheduled_time"}
        if not need <= set(reader.fieldnames or []):
            raise TraceError(f"{pods_path}: expected columns {','.join(sorted(need))}")
        for lineno, row in enumerate(reader, start=2):
            try:
                created = int(row["creation_time"])
                if not window.keeps(created):
                    continue
                num_gpu, milli = int(row["num_gpu"]), int(row["gpu_milli"])
                if num_gpu == 0 or milli == 0:
                    cpu_only += 1
                    continue
                started = int(row["scheduled_time"]) if row["scheduled_time"] else created
                duration = max(1, int(row["deletion_time"]) - started)
                job_id = row["name"].strip()
                fractional = num_gpu == 1 and milli <= 1000 // OPENB_SLICES_PER_GPU
                shared = fractions and num_gpu == 1 and milli < 1000
                jobs.append(TraceJob(
                    job_id=job_id, submit_time=created, duration=duration, team=OPENB_QUEUE, queue=OPENB_QUEUE,
                    pods=1, gpus_per_pod=1 if fractional else num_gpu,
                    mig_profile=OPENB_SLICE_PROFILE if fractional and not fractions else None,
                    share_milli=milli if shared else 0,
                    gpu_models=tuple(sorted(m for m in row["gpu_spec"].split("|") if m)),
                    priority_class=QOS_PRIORITY.get(row["qos"].strip(), "normal"),
                    max_runtime_s=estimate_runtime(duration, job_id, seed),
                    checkpoint_interval_s=checkpoint_interval(job_id, seed),
                    cpu_milli=int(row["cpu_milli"]), memory_mib=int(row["memory_mib"]),
                ))
            except (KeyError, ValueError) as exc:
                raise TraceError(f"{pods_path}: line {lineno}: {exc}") from None
    return jobs, cpu_only


def _narrow_to_shared(jobs: list[TraceJob], shared_models: tuple[str, ...]) -> int:
    """A fractional pod may only land on a model that has shared nodes: its any-of list is narrowed to those models
    (in place); when none is left it takes a whole GPU instead. Returns how many pods were narrowed."""
    narrowed = 0
    for i, j in enumerate(jobs):
        if j.mig_profile is None and not j.share_milli:
            continue
        models = tuple(m for m in (j.gpu_models or shared_models) if m in shared_models)
        if not models:
            jobs[i] = replace(j, mig_profile=None, share_milli=0)
            narrowed += 1
        elif models != (j.gpu_models or shared_models):
            jobs[i] = replace(j, gpu_models=models)
            narrowed += 1
        else:
            jobs[i] = replace(j, gpu_models=models)
    return narrowed


def load_openb(pods_path: Path, *, nodes_path: Path | None = None, topology_path: Path | None = None,
               window: Window = Window(), seed: int = 0, sharing: str = "round") -> Trace:
    """Alibaba openb pod list (one pod = one job) with its node list.

    `sharing` "round" (the default, the old replay): fractional GPUs (`gpu_milli` < 1000) become MIG-like slices:
    a pod asking <= 500 milli-GPU takes one half-GPU slice (profile `half`) on a shared node; a larger fraction
    takes a whole GPU (two halves cannot be combined). Per model, nodes are set aside as shared nodes (2 slices per
    GPU) in proportion to the slice demand of the trace (GPU-seconds asked as slices ÷ all GPU-seconds), rounded.
    `sharing` "time-slicing" or "mps": a fractional pod asks its fraction (`gpu_fraction` = gpu_milli / 1000), and
    the nodes set aside the same way (in proportion to the GPU-seconds the fractions need: a fraction above one half
    counts a whole GPU, as no two such pods share one) share their GPUs in
    that mode, with as many replicas per GPU as the smallest fraction of the trace allows (1000 // its
    gpu_milli); quotas get `<model>:gpu-share` (the shared GPUs × 1000). CPU-only pods are dropped. Duration =
    deletion - scheduled time (creation time when never scheduled). qos -> priority: LS/Guaranteed = high,
    Burstable = normal, BE = low. `gpu_spec` is the any-of model list."""
    if sharing not in OPENB_SHARING:
        raise TraceError(f"unknown GPU sharing {sharing!r} for openb; choose from {', '.join(OPENB_SHARING)}")
    fractions = sharing != "round"
    nodes_path = nodes_path or pods_path.with_name("openb_node_list_gpu_node.csv")
    jobs, cpu_only = _openb_jobs(pods_path, window, seed, fractions)
    jobs, _t0 = _rebase(jobs)
    if fractions:
        # GPU-seconds the fractions need: a pod above half a GPU shares its GPU with no other such pod, so it
        # counts whole (two never fit one GPU); the smaller ones count their fraction
        slice_demand = sum(j.duration * (1000 if j.share_milli > 500 else j.share_milli) for j in jobs) / 1000
    else:
        slice_demand = sum(j.duration for j in jobs if j.mig_profile) / OPENB_SLICES_PER_GPU
    whole_demand = sum(j.duration * j.gpus for j in jobs)
    shared_fraction = slice_demand / (slice_demand + whole_demand) if jobs else 0.0
    smallest = min((j.share_milli for j in jobs if j.share_milli), default=500)
    mode = SharingMode(sharing) if fractions else None
    nodes = _openb_nodes(nodes_path, shared_fraction, mode, max(2, 1000 // smallest))
    # A fractional pod may only land on a model that has shared nodes: its any-of list is narrowed to those
    # models (empty list = any of them); when none is left it takes a whole GPU instead.
    shared_models = tuple(sorted({n.gpu_model for n in nodes if n.mig is not None or n.sharing is not None}))
    narrowed = _narrow_to_shared(jobs, shared_models)
    if topology_path is not None:
        nodes = apply_topology(nodes, load_topology_csv(topology_path))
    # Quota per resource as the admission core names them: whole GPUs under the model, slices of shared
    # nodes under "<model>:<profile>" (so a fractional pod is charged one slice, not a whole GPU).
    capacity: dict[str, int] = {}
    for n in nodes:
        if n.sharing is not None:
            key = f"{n.gpu_model}:gpu-share"
            capacity[key] = capacity.get(key, 0) + n.shared_gpus * 1000
            continue
        key = f"{n.gpu_model}:{n.mig.profile}" if n.mig else n.gpu_model
        capacity[key] = capacity.get(key, 0) + n.gpus * (n.mig.slices_per_gpu if n.mig else 1)
    queues = queues_for_teams([OPENB_QUEUE], dict(sorted(capacity.items())), cohort="openb")
    info: dict[str, object] = {"format": "openb", "rows_kept": len(jobs), "cpu_only_dropped": cpu_only,
                               "shared_node_fraction": round(shared_fraction, 4),
                               "fractional_pods_narrowed": narrowed, "gpu_sharing": sharing}
    return Trace(name=pods_path.stem, jobs=jobs, nodes=nodes, queues=queues, epoch0=0.0, info=info)


def _openb_nodes(path: Path, shared_fraction: float, mode: SharingMode | None = None,
                 replicas: int = 2) -> list[NodeSpec]:
    rows: list[tuple[str, int, int, int, str]] = []
    with _open(path) as fh:
        reader = csv.DictReader(fh)
        if not {"sn", "cpu_milli", "memory_mib", "gpu", "model"} <= set(reader.fieldnames or []):
            raise TraceError(f"{path}: expected header sn,cpu_milli,memory_mib,gpu,model")
        for lineno, row in enumerate(reader, start=2):
            try:
                rows.append((row["sn"].strip(), int(row["cpu_milli"]), int(row["memory_mib"]), int(row["gpu"]),
                             row["model"].strip()))
            except ValueError as exc:
                raise TraceError(f"{path}: line {lineno}: {exc}") from None
    rows.sort()
    by_model: dict[str, list[tuple[str, int, int, int, str]]] = {}
    for r in rows:
        if r[3] > 0:
            by_model.setdefault(r[4], []).append(r)
    nodes: list[NodeSpec] = []
    for model, group in sorted(by_model.items()):
        shared = round(len(group) * shared_fraction)
        for i, (sn, cpu, mem, gpus, _) in enumerate(group):
            # The last `shared` nodes of each model (by serial number) are partitioned into half-GPU slices.
            # (or, with a sharing mode, share their GPUs by it)
            part = i >= len(group) - shared
            mig = MigLayout(profile=OPENB_SLICE_PROFILE, slices_per_gpu=OPENB_SLICES_PER_GPU) \
                if part and mode is None else None
            sharing = GpuSharing(mode=mode, replicas=replicas) if part and mode is not None else None
            nodes.append(NodeSpec(name=sn, gpus=gpus, gpu_model=model, cpu_milli=cpu, memory_mib=mem, mig=mig,
                                  sharing=sharing, rack=f"{model.lower()}-rack{i // 8}",
                                  block=f"{model.lower()}-block{i // 64}"))
    return nodes
