"""`cluster.yaml` and `queues.yaml`: the canonical configuration formats (architecture guide, section 4).

Both are validated with pydantic; any problem raises `ConfigError` naming the file, the path inside the file
and what is wrong. Load-time warnings flag the classic mistakes (guarantees above capacity, a queue that can
borrow nothing, preemption enabled for production classes) without refusing the file.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.domain import NAME_RE, JobKind, MigLayout, NodeSpec, Precision, Taint, unset
from shared.interactive import NO_CLASS_POLICY, NOTEBOOK_DEFAULT, Budget, JobClassPolicy, UserLimits
from shared.quota_keys import POOL, is_non_gpu, quota_key_problems


class ConfigError(ValueError):
    """A configuration file is invalid. `problems` holds (path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {source}: {path or '<root>'}: {msg}" for path, msg in problems)
        super().__init__(f"invalid configuration in {source}:\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- cluster.yaml


class NodeGroup(_Strict):
    name: str
    count: int = Field(ge=1, le=100_000)
    gpus_per_node: int = Field(ge=0, le=64)
    gpu_model: str = Field(min_length=1)
    cpu_milli: int = Field(ge=0)
    memory_mib: int = Field(ge=0)
    nodes_per_rack: int = Field(default=4, ge=1)
    racks_per_block: int | None = Field(default=None, ge=1)
    mig: MigLayout | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    datasets: tuple[str, ...] = ()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name (lower-case letters, digits, '.', '_', '-')")
        return v


class ClusterSource(StrEnum):
    STATIC = "static"  # node_groups: the simulated executor and the simulator
    KUBERNETES = "kubernetes"  # nodes read from the Kubernetes API (services/executor/kube)


class KubernetesSource(_Strict):
    """How the Kubernetes executor reads nodes and runs workloads (cluster.yaml, `source: kubernetes`).

    Defaults follow NVIDIA GPU Feature Discovery and the device plugin's mixed MIG strategy."""

    # GPU model: the node label's value (GFD's product name) through this map to a flavor of queues.yaml;
    # a product missing from the map is its own flavor name.
    gpu_product_label: str = "nvidia.com/gpu.product"
    gpu_flavors: dict[str, str] = Field(default_factory=dict)
    gpu_memory_label: str = "nvidia.com/gpu.memory"  # MiB, informational (kept in the node's labels)
    pool_label: str | None = None  # copied to the node's `pool` label, which jobs select on
    # Topology: label keys from the widest level to the narrowest above the node. The narrowest is gpuq's rack,
    # the one before it the block (a domain is the path of values, so racks of two blocks never merge).
    topology_levels: tuple[str, ...] = ("network.topology.nvidia.com/spine", "network.topology.nvidia.com/block")
    datasets_key: str = "gpuq.io/datasets"  # label or annotation: comma-separated datasets cached on the node
    node_selector: dict[str, str] = Field(default_factory=dict)  # only nodes with these labels are gpuq's
    # Node labels left out of what gpuq announces (jobs' nodeSelector and node affinity are matched against the
    # others): labels that change on their own every few minutes, which would announce the node again each time.
    # An entry ending in `*` is a prefix.
    ignored_labels: tuple[str, ...] = ("nvidia.com/gfd.timestamp",)
    resync_s: float = Field(default=300.0, gt=0)  # full relist of nodes and workloads this often
    # Gang readiness (Kueue's waitForPodsReady): a placed gang not all Ready in time is suspended and requeued
    # after a backoff of base * 2^(attempt-1), at most requeue_limit times; then it fails.
    pods_ready_timeout_s: float = Field(default=600.0, gt=0)
    requeue_backoff_s: float = Field(default=60.0, ge=0)
    requeue_limit: int = Field(default=5, ge=0)
    image_pull_timeout_s: float = Field(default=300.0, gt=0)  # an image that cannot be pulled fails the job then
    # A pod kube-scheduler cannot bind where gpuq placed it is requeued when that lasts this long (the GPUs of a
    # preempted job's pods are free only after their termination grace period, so a short wait is normal).
    bind_timeout_s: float = Field(default=120.0, gt=0)
    namespace: str | None = None  # watch one namespace only (tests, single-tenant installs); None = all
    # Scale-down (off by default): gpuq annotates the nodes it holds a job on, or held one on less than this long
    # ago, cluster-autoscaler.kubernetes.io/scale-down-disabled=true, and releases the others to the autoscaler.
    scale_down_cooldown_s: float | None = Field(default=None, ge=0)
    # Spot interruption notices (docs/kubernetes.md, "Spot"): a node that gets one of these taints, as the cloud's
    # termination handlers set them, is about to be reclaimed; the jobs there that can checkpoint are asked for one
    # at once and requeued from it (at the latest interruption_checkpoint_s after the notice).
    interruption_taints: tuple[str, ...] = ("aws-node-termination-handler/spot-itn",
                                            "cloud.google.com/impending-node-termination")
    interruption_checkpoint_s: float = Field(default=90.0, gt=0)
    # The spot flavor (docs/kubernetes.md, "Spot"): nodes whose labels include all of these (e.g.
    # {karpenter.sh/capacity-type: spot}, {cloud.google.com/gke-spot: "true"}, {eks.amazonaws.com/capacityType: SPOT})
    # are spot capacity, which gpuq gives only to preemptible jobs of queues with spot_for_preemptible; {} = none.
    spot_selector: dict[str, str] = Field(default_factory=dict)


LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
SELECTOR_RE = re.compile(rf"^(?:{_MATCHER}(?:,{_MATCHER})*,?\s*)?$")
# XIDs that are the application's fault, not the GPU's: the GPU stays healthy. The list NVIDIA's Kubernetes
# device plugin skips in its health check (13, 31, 43, 45, 68), plus 109 (context switch timeout), which NVIDIA's
# XID catalogue also lists as an application error.
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)


class DcgmPodLabels(_Strict):
    """One pair of labels naming the workload pod of a series. After Prometheus relabelling, the exporter's own
    `pod`/`namespace` clash with the target's and arrive as `exported_pod`/`exported_namespace`."""

    namespace: str
    pod: str


class DcgmLabels(_Strict):
    """Label names of dcgm-exporter series as they reach Prometheus. Lists are tried in order, first non-empty wins."""

    node: tuple[str, ...] = Field(default=("Hostname", "hostname"), min_length=1)  # renamed to hostname in 2026
    gpu: str = "gpu"
    uuid: str = "UUID"
    gpu_instance: str = "GPU_I_ID"
    gpu_instance_profile: str = "GPU_I_PROFILE"
    pods: tuple[DcgmPodLabels, ...] = (DcgmPodLabels(namespace="exported_namespace", pod="exported_pod"),
                                       DcgmPodLabels(namespace="namespace", pod="pod"))

    @model_validator(mode="after")
    def _label_names(self) -> DcgmLabels:
        names = [*self.node, self.gpu, self.uuid, self.gpu_instance, self.gpu_instance_profile]
        names += [n for p in self.pods for n in (p.namespace, p.pod)]
        bad = sorted({n for n in names if not LABEL_NAME_RE.match(n)})
        if bad:
            raise ValueError(f"not valid Prometheus label names: {', '.join(bad)}")
        return self


class DcgmSettings(_Strict):
    """Real GPU utilisation and health from dcgm-exporter series, read through the Prometheus HTTP API
    (docs/observability.md, "GPU utilisation from DCGM"). Absent = the simulated executor's synthetic samples."""

    prometheus_url: str
    interval_s: float = Field(default=15.0, ge=1, le=3600)  # one poll (and one sample per GPU) per interval
    # Each poll averages a series over this window (`avg_over_time`); default 2 × interval_s, so that one missed
    # scrape does not drop a sample.
    lookback_s: float | None = Field(default=None, ge=1, le=3600)
    timeout_s: float = Field(default=10.0, gt=0, le=300)
    selector: str = ""  # extra label matchers for every query, e.g. 'job="dcgm-exporter", cluster="prod"'
    labels: DcgmLabels = DcgmLabels()
    ignore_xids: tuple[int, ...] = APPLICATION_XIDS
    missing_gpu_polls: int = Field(default=3, ge=1)  # a GPU absent this many polls in a row has left the bus
    recovery_polls: int = Field(default=3, ge=1)  # a degraded node with no fault this many polls is ready again

    @field_validator("prometheus_url")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", v):
            raise ValueError(f"{v!r} is not an http(s) URL of a Prometheus server (e.g. http://prometheus:9090)")
        return v

    @field_validator("selector")
    @classmethod
    def _selector(cls, v: str) -> str:
        v = v.strip().removeprefix("{").removesuffix("}")
        if not SELECTOR_RE.match(v):
            raise ValueError(f"{v!r} is not a list of PromQL label matchers "
                             'like job="dcgm-exporter", cluster=~"a|b"')
        return v.strip().rstrip(",")

    @model_validator(mode="after")
    def _timing(self) -> DcgmSettings:
        if self.timeout_s > self.interval_s:
            raise ValueError(f"timeout_s ({self.timeout_s}) must not exceed interval_s ({self.interval_s}): "
                             "polls would overlap")
        return self

    @property
    def window_s(self) -> float:
        return self.lookback_s if self.lookback_s is not None else 2 * self.interval_s


def dcgm_settings(cluster: ClusterConfig | None, env: Mapping[str, str]) -> DcgmSettings | None:
    """The DCGM source's settings: cluster.yaml's `dcgm` section, with GPUQ_DCGM_PROMETHEUS_URL and
    GPUQ_DCGM_INTERVAL_S overriding (the URL alone enables the source). None = keep the synthetic samples."""
    base = cluster.dcgm if cluster is not None else None
    doc: dict[str, Any] = base.model_dump() if base is not None else {}
    for var, key in (("GPUQ_DCGM_PROMETHEUS_URL", "prometheus_url"), ("GPUQ_DCGM_INTERVAL_S", "interval_s")):
        raw = env.get(var, "").strip()
        if raw:
            doc[key] = raw
    if not doc:
        return None
    if "prometheus_url" not in doc:
        raise ConfigError("environment", [("GPUQ_DCGM_INTERVAL_S", "set GPUQ_DCGM_PROMETHEUS_URL (or cluster.yaml "
                                                                   "dcgm.prometheus_url) too")])
    try:
        return DcgmSettings.model_validate(doc)
    except ValidationError as exc:
        where = {"prometheus_url": "GPUQ_DCGM_PROMETHEUS_URL", "interval_s": "GPUQ_DCGM_INTERVAL_S"}
        problems = []
        for e in exc.errors():
            key = str(e["loc"][0]) if e["loc"] else ""
            from_env = key in where and env.get(where[key], "").strip()
            problems.append((where[key] if from_env else f"dcgm.{_loc(e['loc'])}" if key else "dcgm",
                             e["msg"].removeprefix("Value error, ")))
        raise ConfigError("environment / cluster.yaml", problems) from None


class ClusterConfig(_Strict):
    source: ClusterSource = ClusterSource.STATIC
    node_groups: tuple[NodeGroup, ...] = ()
    topology_file: str | None = None
    kubernetes: KubernetesSource | None = None
    dcgm: DcgmSettings | None = None  # real utilisation and GPU health from dcgm-exporter via Prometheus

    @model_validator(mode="after")
    def _unique(self) -> ClusterConfig:
        if self.source is ClusterSource.STATIC and not self.node_groups:
            raise ValueError("node_groups: a static cluster needs at least one node group "
                             "(or set source: kubernetes to read the nodes from the cluster)")
        if self.source is ClusterSource.KUBERNETES and self.node_groups:
            raise ValueError("node_groups: a kubernetes cluster reads its nodes from the API; remove node_groups")
        if self.source is ClusterSource.STATIC and self.kubernetes is not None:
            raise ValueError("kubernetes: only used with source: kubernetes")
        names = [g.name for g in self.node_groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node group names must be unique; repeated: {', '.join(dupes)}")
        return self

    @property
    def kube(self) -> KubernetesSource:
        """The Kubernetes settings (defaults when the section is absent)."""
        return self.kubernetes or KubernetesSource()

    @property
    def total_gpus(self) -> int:
        return sum(g.count * g.gpus_per_node for g in self.node_groups)

    def gpus_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.node_groups:
            out[g.gpu_model] = out.get(g.gpu_model, 0) + g.count * g.gpus_per_node
        return dict(sorted(out.items()))

    def nodes(self, base_dir: Path | None = None) -> list[NodeSpec]:
        """Expand the groups into nodes `<group>-<index>` with a generated node -> rack -> block path.

        With `topology_file`, the CSV's mapping overrides the generated one (see `load_topology_csv`).
        """
        nodes: list[NodeSpec] = []
        for g in self.node_groups:
            racks_per_block = g.racks_per_block or 1_000_000
            for i in range(g.count):
                rack_index = i // g.nodes_per_rack
                nodes.append(
                    NodeSpec(
                        name=f"{g.name}-{i}",
                        gpus=g.gpus_per_node,
                        gpu_model=g.gpu_model,
                        cpu_milli=g.cpu_milli,
                        memory_mib=g.memory_mib,
                        mig=g.mig,
                        labels=g.labels,
                        taints=g.taints,
                        rack=f"{g.name}-rack{rack_index}",
                        block=f"{g.name}-block{rack_index // racks_per_block}",
                        datasets=g.datasets,
                    )
                )
        if self.topology_file:
            path = Path(self.topology_file)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            nodes = apply_topology(nodes, load_topology_csv(path))
        return nodes


def load_topology_csv(path: Path) -> list[tuple[str, str, str]]:
    """Read a host -> rack -> block CSV. Accepts `host,rack,block` or the Clos form `ip,DSW,PSW,ASW`
    (top-of-rack switch ASW = rack, aggregation switch PSW = block). Rows are returned sorted so that
    hosts sharing a rack are adjacent, which makes the order-based assignment below keep racks whole."""
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            fields = set(reader.fieldnames or [])
            rows: list[tuple[str, str, str]] = []
            if {"host", "rack", "block"} <= fields:
                rows = [(r["host"], r["rack"], r["block"]) for r in reader]
            elif {"ip", "PSW", "ASW"} <= fields:
                rows = [(r["ip"], f"{r['PSW']}/{r['ASW']}", r["PSW"]) for r in reader]
            else:
                raise ConfigError(str(path), [("", "expected columns host,rack,block or ip,DSW,PSW,ASW")])
    except OSError as exc:
        raise ConfigError(str(path), [("", f"cannot read topology file: {exc.strerror}")]) from exc
    return sorted(rows, key=lambda r: (r[2], r[1], r[0]))


def apply_topology(nodes: list[NodeSpec], rows: list[tuple[str, str, str]]) -> list[NodeSpec]:
    """Hosts named like nodes take their own row; otherwise nodes take rows in order (real topology files
    name hosts by IP or hash, not by our generated names). Nodes beyond the file keep the generated path."""
    by_host = {h: (r, b) for h, r, b in rows}
    if any(n.name in by_host for n in nodes):
        return [n.model_copy(update=dict(zip(("rack", "block"), by_host[n.name], strict=True)))
                if n.name in by_host else n for n in nodes]
    return [
        n.model_copy(update={"rack": rows[i][1], "block": rows[i][2]}) if i < len(rows) else n
        for i, n in enumerate(nodes)
    ]


# --------------------------------------------------------------------------- queues.yaml


class PriorityClass(_Strict):
    name: str
    value: int
    preemptible: bool = True
    # Whether a job of this (preemptible) class may opt out of preemption (`preemptible: false` in its spec) without
    # a platform admin's approval. Default false: such a job waits, reason AwaitingApproval, until `gpuq approve`
    # (a guarantee nobody can take back must not be free; docs/admission.md, "Non-preemptible jobs"). A class
    # that is itself never preempted (`preemptible: false`, production) needs no opt-out.
    allow_non_preemptible: bool = False


class FlavorQuota(_Strict):
    nominal: int = Field(ge=0)
    borrowing_limit: int | None = Field(default=None, ge=0)  # None = unlimited
    lending_limit: int | None = Field(default=None, ge=0)  # None = all unused nominal is lendable

    @model_validator(mode="after")
    def _lending_within_nominal(self) -> FlavorQuota:
        if self.lending_limit is not None and self.lending_limit > self.nominal:
            raise ValueError(f"lending_limit {self.lending_limit} exceeds nominal {self.nominal}")
        return self


class CohortQuota(_Strict):
    """A cohort's own quota per GPU model (Kueue Cohort `resourceGroups`): `nominal` is a shared pool on top of
    the members' quotas; `borrowing_limit` bounds what the cohort's subtree may take from its parent's, and
    `lending_limit` what it lends to it (both only for a cohort with a parent, as in Kueue). Unlike a queue's,
    a cohort's lending limit counts its whole subtree's quota (Kueue's SubtreeQuota), not just `nominal`."""

    nominal: int = Field(default=0, ge=0)
    borrowing_limit: int | None = Field(default=None, ge=0)  # None = unlimited
    lending_limit: int | None = Field(default=None, ge=0)  # None = the whole subtree's unused quota is lendable


class Cohort(_Strict):
    """A cohort pools its members' unused quota. With `parent` it is a node of a cohort tree (Kueue KEP-79
    hierarchical cohorts): what its subtree lends flows up to the parent, and its members may borrow from the
    whole tree, within the borrowing and lending limits of every cohort on the way."""

    name: str
    parent: str | None = None
    quotas: dict[str, CohortQuota] = Field(default_factory=dict)

    @field_validator("quotas")
    @classmethod
    def _quota_keys(cls, v: dict[str, CohortQuota]) -> dict[str, CohortQuota]:
        return _checked_keys(v)


class FairSharingStrategy(StrEnum):
    """Kueue `fairSharing.preemptionStrategies` (KEP-1714 rules S2-a and S2-b)."""

    LESS_THAN_OR_EQUAL_TO_FINAL_SHARE = "LessThanOrEqualToFinalShare"
    LESS_THAN_INITIAL_SHARE = "LessThanInitialShare"


_FAIR_STRATEGY_LISTS = (
    (FairSharingStrategy.LESS_THAN_OR_EQUAL_TO_FINAL_SHARE,),
    (FairSharingStrategy.LESS_THAN_INITIAL_SHARE,),
    (FairSharingStrategy.LESS_THAN_OR_EQUAL_TO_FINAL_SHARE, FairSharingStrategy.LESS_THAN_INITIAL_SHARE),
)


class FairSharing(_Strict):
    """Kueue's `fairSharing` configuration: with `preemption: true`, a job that must borrow and finds too little
    lendable may preempt other queues' borrowers when the strategies say its queue's share (after admitting it)
    is not above theirs (docs/admission.md). Off by default: borrowers are then only taken back by reclaim."""

    preemption: bool = False
    preemption_strategies: tuple[FairSharingStrategy, ...] = (
        FairSharingStrategy.LESS_THAN_OR_EQUAL_TO_FINAL_SHARE, FairSharingStrategy.LESS_THAN_INITIAL_SHARE)

    @field_validator("preemption_strategies")
    @classmethod
    def _strategies(cls, v: tuple[FairSharingStrategy, ...]) -> tuple[FairSharingStrategy, ...]:
        if v not in _FAIR_STRATEGY_LISTS:
            raise ValueError("preemption_strategies must be [LessThanOrEqualToFinalShare], [LessThanInitialShare] "
                             "or [LessThanOrEqualToFinalShare, LessThanInitialShare] (as in Kueue)")
        return v


class PreemptionPolicy(StrEnum):
    NEVER = "Never"
    LOWER_PRIORITY = "LowerPriority"
    ANY = "Any"  # reclaim any borrower regardless of priority (Kueue's `Any`)


class BorrowWithinCohort(_Strict):
    """Kueue `borrowWithinCohort`: a job that must borrow may preempt other queues' borrowers of strictly lower
    priority (and at most `max_priority_threshold`, when set) to get the room it borrows."""

    policy: PreemptionPolicy = PreemptionPolicy.NEVER
    max_priority_threshold: int | None = None

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: PreemptionPolicy) -> PreemptionPolicy:
        if v is PreemptionPolicy.ANY:
            raise ValueError("borrow_within_cohort.policy is Never or LowerPriority (as in Kueue)")
        return v


class QueuePreemption(_Strict):
    within_queue: PreemptionPolicy = PreemptionPolicy.LOWER_PRIORITY
    reclaim_within_cohort: PreemptionPolicy = PreemptionPolicy.LOWER_PRIORITY
    borrow_within_cohort: BorrowWithinCohort = BorrowWithinCohort()


class QueueingStrategy(StrEnum):
    STRICT_FIFO = "StrictFIFO"
    BEST_EFFORT_FIFO = "BestEffortFIFO"


class PlacementStrategy(StrEnum):
    """How the scheduler picks nodes for a queue's pods (docs/scheduler.md, "Placement strategy per queue"):
    `binpack` fills the fullest nodes that fit first (keeps whole nodes free for gangs); `spread` the emptiest."""

    BINPACK = "binpack"
    SPREAD = "spread"


class StopPolicy(StrEnum):
    """Kueue's ClusterQueue `stopPolicy`: `None` admits as usual; `Hold` admits nothing more (jobs already
    admitted keep running and their quota); `HoldAndDrain` admits nothing and also evicts the queue's admitted jobs
    that may be preempted, through the preemption service's checkpoint-before-preempt protocol. Jobs of a class
    that is never preempted (production) keep running: a promise to users outranks the drain (docs/admission.md)."""

    NONE = "None"
    HOLD = "Hold"
    HOLD_AND_DRAIN = "HoldAndDrain"


class ProvisioningClass(StrEnum):
    """The cluster-autoscaler's ProvisioningRequest classes gpuq asks with (docs/kubernetes.md, "Capacity")."""

    CHECK_CAPACITY = "check-capacity.autoscaling.x-k8s.io"  # is the capacity there now? (booked, not added)
    BEST_EFFORT_ATOMIC_SCALE_UP = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"  # add all of it, or none


class Provisioning(_Strict):
    """A queue's opt-in to ask the cluster-autoscaler for capacity (Kueue's ProvisioningRequest admission check):
    the job at the head of the queue that waits for capacity the cluster lacks gets a ProvisioningRequest."""

    class_name: ProvisioningClass = ProvisioningClass.BEST_EFFORT_ATOMIC_SCALE_UP
    flavors: tuple[str, ...] = ()  # only jobs on these GPU flavors; () = every flavor of the queue
    parameters: dict[str, str] = Field(default_factory=dict)  # spec.parameters, e.g. ValidUntilSeconds
    # A Failed request is asked again after backoff_s * 2^(n-1) (at most 30 min), at most retry_limit times.
    retry_limit: int = Field(default=3, ge=0)
    backoff_s: float = Field(default=60.0, ge=0)


class PoolStep(StrEnum):
    """What admission does with a node pool of a queue's `pools` order (Kueue's FlavorFungibility): take it
    (`Borrow`: fitting by borrowing; `Preempt`: fitting once others are preempted) or look at the next pool first
    (`TryNextPool`)."""

    BORROW = "Borrow"
    PREEMPT = "Preempt"
    TRY_NEXT_POOL = "TryNextPool"


class PoolFungibility(_Strict):
    """How admission walks a queue's `pools` (docs/admission.md, "Node pools as flavors"). By default it prefers a
    pool that fits without borrowing to one that fits by borrowing, and either to preempting."""

    when_can_borrow: PoolStep = PoolStep.TRY_NEXT_POOL
    when_can_preempt: PoolStep = PoolStep.TRY_NEXT_POOL

    @model_validator(mode="after")
    def _steps(self) -> PoolFungibility:
        if self.when_can_borrow is PoolStep.PREEMPT:
            raise ValueError("when_can_borrow is Borrow or TryNextPool, not Preempt")
        if self.when_can_preempt is PoolStep.BORROW:
            raise ValueError("when_can_preempt is Preempt or TryNextPool, not Borrow")
        return self


class QueueConfig(_Strict):
    name: str
    cohort: str | None = None
    teams: tuple[str, ...] = ()
    weight: float = Field(default=1.0, ge=0)
    quotas: dict[str, FlavorQuota] = Field(default_factory=dict)
    max_running_jobs: int | None = Field(default=None, ge=0)
    preemption: QueuePreemption = QueuePreemption()
    queueing_strategy: QueueingStrategy = QueueingStrategy.BEST_EFFORT_FIFO
    max_preemptions_per_hour: int | None = Field(default=None, ge=0)
    # The risk of lost work is taken when a job borrows (a reclaim of the lender's quota always succeeds):
    # a job of this queue that cannot checkpoint may borrow only when its max_runtime_s is at most this.
    # 0 = such jobs never borrow; null = no limit.
    max_borrow_runtime_without_checkpoint_s: int | None = Field(default=None, ge=0)
    stop_policy: StopPolicy = StopPolicy.NONE
    provisioning: Provisioning | None = Field(default=None, exclude_if=unset)  # off by default: none asked
    # Its preemptible jobs may run on spot nodes (kubernetes.spot_selector); unset/false: none of its jobs does.
    spot_for_preemptible: bool | None = Field(default=None, exclude_if=unset)
    # The node order for this queue's jobs; null = the scheduler's own (binpack unless started otherwise).
    placement_strategy: PlacementStrategy | None = Field(default=None, exclude_if=unset)
    # Node pools (the nodes' `pool` label) admission chooses among, in this order, for a job that selects none; the
    # job is charged that pool's `pool/<name>` quota and placed on its nodes. Unset: admission chooses no pool.
    pools: tuple[str, ...] | None = Field(default=None, exclude_if=unset)
    pool_fungibility: PoolFungibility | None = Field(default=None, exclude_if=unset)  # unset: the defaults
    # Those of `pools` that are spot capacity: chosen only for the queue's preemptible jobs (never for the others).
    spot_pools: tuple[str, ...] | None = Field(default=None, exclude_if=unset)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name (lower-case letters, digits, '.', '_', '-')")
        return v

    @field_validator("pools")
    @classmethod
    def _pools(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("pools: list at least one node pool, or leave pools out")
        problems = [f"pools: {name!r} is no value of the nodes' `pool` label (letters, digits, '-', '_', '.'; "
                    "at most 63)" for name in v if quota_key_problems([POOL + name])]
        dup = sorted({name for name in v if v.count(name) > 1})
        if dup:
            problems.append(f"pools: {', '.join(dup)} listed twice")
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _fungibility_needs_pools(self) -> QueueConfig:
        for field in ("pool_fungibility", "spot_pools"):
            if getattr(self, field) is not None and self.pools is None:
                raise ValueError(f"queue {self.name}: {field} is set but pools is not (the node pools admission "
                                 "chooses among, in order)")
        if self.spot_pools is not None and self.pools is not None:
            unknown = sorted(set(self.spot_pools) - set(self.pools))
            if unknown:
                raise ValueError(f"queue {self.name}: spot_pools {', '.join(unknown)} not in its pools "
                                 f"({', '.join(self.pools)})")
            if set(self.pools) <= set(self.spot_pools):
                raise ValueError(f"queue {self.name}: every pool is a spot pool, so its jobs that are not "
                                 "preemptible could never be given one; list an on-demand pool too")
        return self

    @field_validator("quotas")
    @classmethod
    def _quota_keys(cls, v: dict[str, FlavorQuota]) -> dict[str, FlavorQuota]:
        return _checked_keys(v)


_Q = TypeVar("_Q")


def _checked_keys(quotas: dict[str, _Q]) -> dict[str, _Q]:
    """Quota keys beyond GPU models are spelled as shared/quota_keys.py says (`cpu` is no key: `cpu_milli` is)."""
    problems = quota_key_problems(quotas)
    if problems:
        raise ValueError("; ".join(problems))
    return quotas


def placement_strategies(config: QueuesConfig | None) -> dict[str, str]:
    """Queue -> the placement strategy it sets (only the queues that set one), for the scheduler core's index."""
    if config is None:
        return {}
    return {q.name: str(q.placement_strategy) for q in config.queues if q.placement_strategy is not None}


class GpuFlavor(_Strict):
    """Per GPU model: weight for fair share (one H100 is not one T4), price for metering, and the peak dense
    throughput per GPU in TFLOP/s by precision, the denominator of MFU (e.g. H100 SXM: bf16 989, fp8 1979)."""

    weight: float = Field(default=1.0, gt=0)
    cost_per_gpu_hour: float = Field(default=1.0, ge=0)
    peak_tflops: dict[Precision, float] = Field(default_factory=dict)

    @field_validator("peak_tflops")
    @classmethod
    def _positive(cls, v: dict[Precision, float]) -> dict[Precision, float]:
        bad = sorted(str(p) for p, t in v.items() if not t > 0 or t == float("inf"))
        if bad:
            raise ValueError(f"peak TFLOP/s must be positive and finite; check {', '.join(bad)}")
        return v


class Defragmentation(_Strict):
    """Defragmentation that keeps progress (docs/preemption.md, "Defragmentation"): when an admitted gang waits while
    enough GPUs of its models are free in total but scattered, checkpointing jobs are moved (checkpoint, requeue
    with a placement hint on the holes, the gang placed on the GPUs they freed). Off by default: a move stops a
    running job, which users of a cluster without it were not told to expect."""

    enabled: bool = False
    # At most this many jobs moved per sliding hour, cluster-wide: a move costs its job a checkpoint write and a
    # restart (minutes), so 12 (one every 5 minutes on average, the scale of the default checkpoint grace) keeps
    # at most a few moves in flight at once, whatever the cluster's size.
    max_moves_per_hour: int = Field(default=12, ge=0)
    # A job moved once is not moved again for this long: each job loses at most one checkpoint write and restart
    # to moves per hour.
    job_cooldown_s: int = Field(default=3600, ge=0)
    # A gang needing more moves than this is left to wait: each move has a cost, and jobs ending free room anyway.
    max_moves_per_gang: int = Field(default=4, ge=1)
    # Not for a gang planned to start within this anyway (its reservation): a move's checkpoint write and restart
    # cost minutes, so saving less than that gains nothing.
    min_wait_saved_s: int = Field(default=600, ge=0)


class Policy(_Strict):
    protection_window_s: int = Field(default=600, ge=0)
    checkpoint_grace_s: int = Field(default=300, ge=0)
    # A running job is not a victim when preempting it would lose more than this many seconds of its run
    # (work since its last checkpoint, or since its start when it cannot checkpoint). null = no bound.
    max_victim_loss_s: int | None = Field(default=1800, ge=0)
    # Loss-aware reclaim (docs/preemption.md, "Loss-aware reclaim"; issue 49): a reclaim whose victims would lose more
    # than max_victim_loss_s waits for cheaper borrowers leaving their protection window within the lender's deadline;
    # reclaim candidates that checkpoint come first within a priority; a lender with jobs waiting lends only to
    # borrowers it can take back cheaply. Off by default: on Philly October it cut lost work 1.74% -> 1.55% with
    # waits a little lower, but on the 60-day window it raised the average wait 13% and the p99 41% (lost work
    # 1.43% -> 1.11%): not a default until it gains on both.
    loss_aware_reclaim: bool = False
    # Fair share over time (docs/admission.md, "Fair share over time"): each queue's past GPU use, decayed with this
    # half-life, counts in its standing (Slurm's PriorityDecayHalfLife; 604800 = Slurm's 7-day default). The
    # metering service publishes the decayed usage (QueueUsageReported); null = off, only current usage counts.
    usage_half_life_s: int | None = Field(default=None, gt=0)
    # Duration-aware ordering (docs/admission.md, "Duration-aware ordering"): within a priority and fair-share
    # standing, shorter predicted GPU-time first (predicted from limits and the history of finished jobs, never the
    # true duration). Off by default: FIFO within a priority is what users are promised today.
    duration_ordering: bool = False
    # Wait-time aging (docs/admission.md, "Aging"): a job's duration offset shrinks with its wait and is gone after
    # this many seconds (Slurm's PriorityMaxAge), after which no later job passes it. null = no aging.
    max_age_s: int | None = Field(default=None, gt=0)
    # No starvation (services/core/admission/starvation.py): a pending job that waited K x its class's median
    # admission wait (and at least starvation_min_wait_s) while its queue is under its nominal quota turns its
    # queue StrictFIFO until it is admitted. K = starvation_factor; null = off.
    starvation_factor: float | None = Field(default=10.0, gt=0)
    starvation_min_wait_s: int = Field(default=3600, ge=0)
    # Moves of checkpointing jobs that let a gang waiting on scattered free GPUs start (the class above).
    defragmentation: Defragmentation = Defragmentation()


class PodSecurity(StrEnum):
    """Pod Security Standards profiles (kubernetes.io/docs/concepts/security/pod-security-standards)."""

    RESTRICTED = "restricted"
    BASELINE = "baseline"


class TeamPolicy(_Strict):
    """What a team's jobs may use (queues.yaml `governance`); each breach is refused at submit with its reason."""

    # Image references must be under one of these: a registry host (`registry.example.com`, any port; never
    # `registry.example.com.evil.io`), or a host and path prefix (`registry.example.com/team-a`: that path or below
    # it at a '/'); null = any image.
    allowed_images: tuple[str, ...] | None = None
    # Datasets (and volumes claimed by name, NFS exports as `server:/path`) a job may mount: names or shell-style
    # patterns, compared with normalised names (a `..` segment is refused outright); null = any.
    allowed_datasets: tuple[str, ...] | None = None
    # Node paths a job may mount (hostPath volumes): shell-style patterns; none by default (a host path reaches the
    # node's own files, past every dataset rule).
    allowed_host_paths: tuple[str, ...] = ()
    # Other volume sources a job may mount directly while its datasets are restricted (e.g. `csi`, `cephfs`);
    # none by default: they reach storage past the dataset allow-list.
    allowed_volume_sources: tuple[str, ...] = ()
    # Secrets only by reference (a Kubernetes Secret named in a volume or env reference), never a credential
    # written into the job's environment or labels.
    secrets_by_reference_only: bool = True
    # Privileged containers, host namespaces (hostNetwork, hostPID, hostIPC), host ports and capabilities beyond the
    # runtime's defaults: they reach the node past every other rule. Refused unless true.
    allow_privileged: bool = False
    # ServiceAccounts a pod may run as (shell-style patterns); null = any of the pod's own namespace for workloads
    # created in the cluster (their author's own right there), only `default` for event-submitted jobs (the executor
    # creates those with its own rights, so a job must not pick its identity).
    allowed_service_accounts: tuple[str, ...] | None = None
    # Secrets an event-submitted job may reference (secret and projected volumes, env `value_from.secretKeyRef`, a
    # volume's secretRef), in its own namespace: names or shell-style patterns; none by default (the executor would
    # mount any Secret of the namespace for whoever holds the team's token).
    allowed_secrets: tuple[str, ...] = ()
    # The Pod Security Standards profile the executor's pods (event-submitted jobs) are given: `restricted`
    # (runAsNonRoot, seccomp RuntimeDefault, no privilege escalation, every capability dropped) or `baseline`
    # (none of those set; privileged settings and host namespaces are refused either way).
    pod_security: PodSecurity = PodSecurity.RESTRICTED
    max_gpus_per_job: int | None = Field(default=None, ge=1)
    # How fast the team may submit: a token bucket of `submit_burst` submissions refilled at `submit_rate_per_s`
    # (admission's clock); a submission without a token is rejected, reason RateLimited, saying when to retry.
    # null = no limit. The defaults let a sweep of thousands through and stop a runaway producer.
    submit_rate_per_s: float | None = Field(default=100.0, gt=0, allow_inf_nan=False)
    submit_burst: int = Field(default=20_000, ge=1)
    # How many of the team's jobs may wait at once (in its queues or for approval); one more is rejected, reason
    # TooManyPending. null = no cap.
    max_pending_jobs: int | None = Field(default=20_000, ge=1)
    # Priority classes whose jobs wait, reason AwaitingApproval, until an admin runs `gpuq approve JOB`.
    approval_required_classes: tuple[str, ...] = ()
    # Limits on one user inside the team (shared/interactive.py, UserLimits); null = none.
    per_user: UserLimits | None = Field(default=None, exclude_if=unset)


class Governance(_Strict):
    default: TeamPolicy = TeamPolicy()  # teams without a policy of their own
    teams: dict[str, TeamPolicy] = Field(default_factory=dict)

    def for_team(self, team: str) -> TeamPolicy:
        return self.teams.get(team, self.default)


class NamespaceMapping(_Strict):
    """A Kubernetes namespace's team and the queues its workloads may name (like Kueue's LocalQueues): a workload
    labelled `gpuq.io/queue=<queue>` in this namespace is the team's job in that queue. The team comes only from
    here, never from a label the user writes."""

    name: str = Field(min_length=1, max_length=63)
    team: str
    queues: tuple[str, ...] = Field(min_length=1)

    @field_validator("team")
    @classmethod
    def _team(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name (lower-case letters, digits, '.', '_', '-')")
        return v


class QueuesConfig(_Strict):
    priority_classes: tuple[PriorityClass, ...] = Field(min_length=1)
    cohorts: tuple[Cohort, ...] = ()
    queues: tuple[QueueConfig, ...] = Field(min_length=1)
    policy: Policy = Policy()
    gpu_flavors: dict[str, GpuFlavor] = Field(default_factory=dict)
    default_priority_class: str | None = None
    governance: Governance = Governance()
    fair_sharing: FairSharing = FairSharing()
    # Kubernetes: namespace -> team and queues; a pod template's priorityClassName -> gpuq priority class.
    namespaces: tuple[NamespaceMapping, ...] = ()
    kubernetes_priority_classes: dict[str, str] = Field(default_factory=dict)
    # Interactive work and budgets (shared/interactive.py): per job kind, its class policy (notebook has defaults);
    # per team, its GPU-hour budget.
    job_classes: dict[JobKind, JobClassPolicy] = Field(default_factory=dict, exclude_if=unset)
    budgets: dict[str, Budget] = Field(default_factory=dict, exclude_if=unset)

    @model_validator(mode="after")
    def _references(self) -> QueuesConfig:
        problems: list[str] = []
        for what, names in (("priority class", [p.name for p in self.priority_classes]),
                            ("cohort", [c.name for c in self.cohorts]),
                            ("queue", [q.name for q in self.queues])):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                problems.append(f"{what} names must be unique; repeated: {', '.join(dupes)}")
        cohorts = {c.name for c in self.cohorts}
        for i, q in enumerate(self.queues):
            if q.cohort is not None and q.cohort not in cohorts:
                problems.append(f"queues[{i}] ({q.name}): cohort {q.cohort!r} is not declared under cohorts")
            unknown_flavors = [f for f in (q.provisioning.flavors if q.provisioning else ()) if f not in q.quotas]
            if unknown_flavors:
                problems.append(f"queues[{i}] ({q.name}): provisioning.flavors {', '.join(unknown_flavors)} not in "
                                "its quotas")
        problems.extend(_cohort_tree_problems(self.cohorts))
        if self.default_priority_class and self.default_priority_class not in self.priority_class_map:
            problems.append(f"default_priority_class {self.default_priority_class!r} is not a priority class")
        policies = [("governance.default", self.governance.default),
                    *((f"governance.teams.{t}", p) for t, p in sorted(self.governance.teams.items()))]
        for where, policy in policies:
            unknown = [c for c in policy.approval_required_classes if c not in self.priority_class_map]
            if unknown:
                problems.append(f"{where}.approval_required_classes: {', '.join(unknown)} not a priority class")
        names = [n.name for n in self.namespaces]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"namespaces must be listed once; repeated: {', '.join(dupes)}")
        queue_names = {q.name: q for q in self.queues}
        for i, ns in enumerate(self.namespaces):
            for queue in ns.queues:
                declared = queue_names.get(queue)
                if declared is None:
                    problems.append(f"namespaces[{i}] ({ns.name}): queue {queue!r} is not declared under queues")
                elif declared.teams and ns.team not in declared.teams:
                    problems.append(f"namespaces[{i}] ({ns.name}): team {ns.team!r} may not use queue {queue!r} "
                                    f"(allowed: {', '.join(sorted(declared.teams))})")
        bad_teams = sorted(t for t in self.budgets if not NAME_RE.match(t))
        if bad_teams:
            problems.append(f"budgets: {', '.join(map(repr, bad_teams))} not a valid team name")
        for k8s_name, cls in sorted(self.kubernetes_priority_classes.items()):
            if cls not in self.priority_class_map:
                problems.append(f"kubernetes_priority_classes.{k8s_name}: {cls!r} is not a priority class")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # Cached: the config is frozen, and the preemption core asks for these maps millions of times in a
    # replay. Callers must not mutate the returned dicts.
    @cached_property
    def priority_class_map(self) -> dict[str, PriorityClass]:
        return {p.name: p for p in self.priority_classes}

    @cached_property
    def queue_map(self) -> dict[str, QueueConfig]:
        return {q.name: q for q in self.queues}

    @cached_property
    def cohort_roots(self) -> dict[str, str]:
        """Cohort -> the root of its cohort tree (itself when it has no parent). Queues under one root share
        quota: reclaim, sharding and fair sharing work per root."""
        parent = {c.name: c.parent for c in self.cohorts}
        roots: dict[str, str] = {}
        for c in parent:
            node, seen = c, {c}
            while (p := parent.get(node)) is not None and p not in seen:
                seen.add(p)
                node = p
            roots[c] = node
        return roots

    def cohort_root(self, cohort: str | None) -> str | None:
        return None if cohort is None else self.cohort_roots.get(cohort, cohort)

    @cached_property
    def namespace_map(self) -> dict[str, NamespaceMapping]:
        return {n.name: n for n in self.namespaces}

    def team_namespaces(self, team: str) -> tuple[str, ...]:
        """The namespaces mapped to `team` (where its Kubernetes jobs may run), in the order listed."""
        return tuple(n.name for n in self.namespaces if n.team == team)

    def job_class(self, kind: JobKind) -> JobClassPolicy:
        """The class policy of a job kind: its own under `job_classes`, else the notebook defaults for notebooks,
        else none (no cap, no TTL, no idle reclaim)."""
        own = self.job_classes.get(kind)
        if own is not None:
            return own
        return NOTEBOOK_DEFAULT if kind is JobKind.NOTEBOOK else NO_CLASS_POLICY

    def flavor(self, gpu_model: str) -> GpuFlavor:
        return self.gpu_flavors.get(gpu_model, GpuFlavor())

    def warnings(self, cluster: ClusterConfig | None = None) -> list[str]:
        """The seed's classic mistakes: legal, but almost certainly not what the platform team meant."""
        out: list[str] = []
        if cluster is not None:
            capacity = cluster.gpus_by_model()
            guaranteed: dict[str, int] = {}
            for q in self.queues:
                for model, quota in q.quotas.items():
                    if not is_non_gpu(model):  # CPU, memory, pods and node pools are no GPU model
                        guaranteed[model] = guaranteed.get(model, 0) + quota.nominal
            for model, total in sorted(guaranteed.items()):
                have = capacity.get(model, 0)
                if total > have:
                    out.append(f"guaranteed {model} quota sums to {total} GPUs but the cluster has {have}: "
                               "guarantees cannot all be honoured at once")
        for q in self.queues:
            if q.cohort is None:
                continue
            if q.quotas and all(f.borrowing_limit == 0 for f in q.quotas.values()):
                out.append(f"queue {q.name}: borrowing_limit is 0 for every flavor, so it can borrow nothing "
                           f"from cohort {q.cohort}")
            # in a cohort tree it may still borrow from other cohorts or a cohort's own quota
            root = self.cohort_root(q.cohort)
            tree = any(c.parent is not None or c.quotas for c in self.cohorts if self.cohort_root(c.name) == root)
            peers = [p for p in self.queues if p.cohort == q.cohort and p.name != q.name]
            if peers and not tree and all(f.lending_limit == 0 for p in peers for f in p.quotas.values()):
                out.append(f"queue {q.name}: every other queue of cohort {q.cohort} lends 0, "
                           "so it can borrow nothing")
        for p in self.priority_classes:
            if p.preemptible and p.name.startswith("prod"):
                out.append(f"priority class {p.name} is preemptible: production work can be evicted")
        return out


def _cohort_tree_problems(cohorts: tuple[Cohort, ...]) -> list[str]:
    """Hierarchical cohorts: every parent is declared, the parent links form no cycle, and borrowing or lending
    limits are set only on a cohort that has a parent (a root has nobody to borrow from or lend to)."""
    problems: list[str] = []
    parent = {c.name: c.parent for c in cohorts}
    for i, c in enumerate(cohorts):
        if c.parent is None:
            limited = sorted(m for m, f in c.quotas.items()
                             if f.borrowing_limit is not None or f.lending_limit is not None)
            if limited:
                problems.append(f"cohorts[{i}] ({c.name}): borrowing_limit/lending_limit on {', '.join(limited)} "
                                "need a parent cohort (a root cohort has nobody to borrow from or lend to)")
        elif c.parent == c.name:
            problems.append(f"cohorts[{i}] ({c.name}): a cohort cannot be its own parent")
        elif c.parent not in parent:
            problems.append(f"cohorts[{i}] ({c.name}): parent {c.parent!r} is not declared under cohorts")
    reported: set[str] = set()
    for start in sorted(parent):
        path = [start]
        node = parent[start]
        while node is not None and node in parent and node not in path and node != start:
            path.append(node)
            node = parent[node]
        if node == start and len(path) > 1:
            cycle = frozenset(path)
            if not cycle & reported:
                reported |= cycle
                problems.append("cohort parents form a cycle: " + " -> ".join([*path, start]))
    return problems


# --------------------------------------------------------------------------- loading

_M = TypeVar("_M", bound=BaseModel)


def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validate(model: type[_M], data: Any, source: str) -> _M:
    if data is None:
        raise ConfigError(source, [("", "the file is empty")])
    if not isinstance(data, dict):
        raise ConfigError(source, [("", f"expected a mapping at the top level, got {type(data).__name__}")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [(_loc(e["loc"]), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
        raise ConfigError(source, problems) from None


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [("", f"cannot read file: {exc.strerror}")]) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(str(path), [(where, f"not valid YAML: {getattr(exc, 'problem', exc)}")]) from None


def parse_cluster(data: Any, source: str = "<cluster.yaml>") -> ClusterConfig:
    return _validate(ClusterConfig, data, source)


def parse_queues(data: Any, source: str = "<queues.yaml>") -> QueuesConfig:
    return _validate(QueuesConfig, data, source)


def queues_document(config: QueuesConfig) -> dict[str, Any]:
    """The configuration as admission stores and publishes it: its normalized JSON form (defaults filled in), so that
    the same content is the same document whichever file, command or request it came from."""
    return config.model_dump(mode="json")


def queues_hash(config: QueuesConfig) -> str:
    """The content's identity across versions and services (docs/admission.md, "The configuration in force"):
    sha256 of the normalized document with sorted keys, in hex."""
    canonical = json.dumps(queues_document(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def load_cluster(path: str | Path) -> ClusterConfig:
    path = Path(path)
    return parse_cluster(_read_yaml(path), str(path))


def load_queues(path: str | Path) -> QueuesConfig:
    path = Path(path)
    return parse_queues(_read_yaml(path), str(path))
