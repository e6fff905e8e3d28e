"""The domain model every service and the simulator share: the job spec and the node description.

Quantities are integers in fixed units (GPUs, MIG slices, milli-CPU, MiB): quota arithmetic never
uses floats. Models are frozen so a pure core can hold them in snapshots without defensive copies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import to_json

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,126}[a-z0-9])?$")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._:-]{0,190}[A-Za-z0-9])?$")


# What Postgres cannot store, refused when a job spec or an event is validated (docs/events.md, "Limits"), so that a
# submission carrying it is a clear 422 or dead letter naming the field, never a handler failing in Postgres: a NUL
# character (text and jsonb refuse \u0000), a lone surrogate (no UTF-8 encoding exists for it), a string (or a key)
# longer than one event may be (shared.events.MAX_EVENT_BYTES: it could never be published; what is smaller, Postgres
# stores, and admission's governance caps a spec at 64 KiB with a verdict, SpecTooLarge).
MAX_STRING_CHARS = 1024 * 1024
# A validation context key: the caller (shared.events.parse_event) has already checked every string of the input.
STRINGS_CHECKED = "gpuq_strings_checked"


def string_problem(value: str, limit: int = MAX_STRING_CHARS) -> str | None:
    """Why Postgres cannot store `value` (or why gpuq refuses it), or None."""
    if len(value) > limit:
        return f"{len(value)} characters, above the limit of {limit}"
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which Postgres cannot store"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "contains a lone surrogate (an unpaired \\ud800-\\udfff), which is not Unicode text"
    return None


def shown(key: object, limit: int = 40) -> str:
    """A key as an error message names it: escaped (a NUL or a lone surrogate must not reach the message, which is
    stored in Postgres too) and cut short."""
    text = str(key)
    cut = text[:limit].encode("ascii", "backslashreplace").decode("ascii").replace("\x00", "\\x00")
    return cut + ("..." if len(text) > limit else "")


def _all_storable(value: Any) -> bool:
    """True when `unstorable(value)` is surely None, told from its JSON text (written in Rust, several times faster
    than walking it here): no longer than one string may be, without the escape of a NUL; and written at all (a lone
    surrogate has no UTF-8, and the writer refuses it). False: the walk decides."""
    try:
        text = to_json(value)
    except Exception:
        return False
    return len(text) <= MAX_STRING_CHARS and b"\\u0000" not in text


def unstorable(value: Any, path: str = "") -> str | None:
    """The first string of `value` (dict keys and values, lists and tuples, at any depth) that Postgres cannot
    store, as "<path>: <why>"; None when every one can. Iterative: a deep document cannot exhaust the stack.
    Validated models met inside `value` were checked when they were made, and are not entered."""
    if _all_storable(value):
        return None
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            why = string_problem(item)
            if why is not None:
                return f"{where or 'value'}: {why}"
        elif isinstance(item, dict):
            entries = []
            for key, sub in item.items():
                if isinstance(key, str) and (why := string_problem(key)) is not None:
                    return f"{where or 'value'}: key '{shown(key)}': {why}"
                entries.append((f"{where}.{shown(key)}" if where else shown(key), sub))
            stack.extend(reversed(entries))  # popped in document order: the first problem is the one named
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(f"{where}[{i}]", sub) for i, sub in enumerate(item)]))
    return None


def refuse_unstorable(data: Any, info: ValidationInfo) -> Any:
    """A `model_validator(mode="before")` body: raise naming the first string Postgres cannot store, unless the
    caller checked the whole input already (context STRINGS_CHECKED)."""
    if info.context and info.context.get(STRINGS_CHECKED):
        return data
    problem = unstorable(data) if isinstance(data, dict) else None
    if problem is not None:
        raise ValueError(problem)
    return data


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def unset(value: object) -> bool:
    """A field value that says nothing: None or an empty collection (`exclude_if` of fields added since v1)."""
    return value is None or value == () or value == {}


# Fields added to a model since the previous release are written (events, stored specs) only when set: `Field(...,
# exclude_if=unset)`. The previous release's models refuse fields they do not know (extra="forbid"), and during a
# rolling upgrade it reads what this release writes (docs/install.md, "Upgrades while two releases run";
# tests/unit/contracts/test_previous_release_reads.py). A field that is set is written, and the previous release
# refuses it (a dead letter): it could not honour it.


class JobKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"
    NOTEBOOK = "notebook"


class TopologyLevel(StrEnum):
    """Levels of the topology tree, smallest first: node -> rack -> block."""

    NODE = "node"
    RACK = "rack"
    BLOCK = "block"

    @property
    def rank(self) -> int:
        return TOPOLOGY_LEVELS.index(self)


TOPOLOGY_LEVELS: tuple[TopologyLevel, ...] = (TopologyLevel.NODE, TopologyLevel.RACK, TopologyLevel.BLOCK)


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Taint(Frozen):
    key: str
    value: str = ""
    effect: TaintEffect = TaintEffect.NO_SCHEDULE


class Toleration(Frozen):
    """Kubernetes semantics: `Exists` tolerates any value of the key; an empty key with Exists tolerates all."""

    key: str = ""
    operator: str = Field(default="Equal", pattern="^(Equal|Exists)$")
    value: str = ""
    effect: TaintEffect | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect is not None and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return self.key == "" or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


class SelectorOperator(StrEnum):
    """Operators of a node selector requirement (Kubernetes' NodeSelectorOperator)."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


NODE_NAME_FIELD = "metadata.name"  # the one field a `match_fields` requirement may name (as in Kubernetes)


class NodeSelectorRequirement(Frozen):
    """One expression of a node selector term, with Kubernetes' semantics: `In`/`NotIn` compare the label's value
    with `values` (`NotIn` also matches a node without the label), `Exists`/`DoesNotExist` test the key, `Gt`/`Lt`
    compare the label's value as an integer with the one value (a node whose value is not an integer does not
    match)."""

    key: str = Field(min_length=1)
    operator: SelectorOperator
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values_fit_operator(self) -> NodeSelectorRequirement:
        op = self.operator
        if op in (SelectorOperator.IN, SelectorOperator.NOT_IN) and not self.values:
            raise ValueError(f"{self.key} {op.value} needs at least one value")
        if op in (SelectorOperator.EXISTS, SelectorOperator.DOES_NOT_EXIST) and self.values:
            raise ValueError(f"{self.key} {op.value} takes no values")
        integer = len(self.values) == 1 and re.fullmatch(r"-?\d+", self.values[0]) is not None
        if op in (SelectorOperator.GT, SelectorOperator.LT) and not integer:
            raise ValueError(f"{self.key} {op.value} needs exactly one integer value")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        op = self.operator
        if op is SelectorOperator.IN:
            return value is not None and value in self.values
        if op is SelectorOperator.NOT_IN:
            return value is None or value not in self.values
        if op is SelectorOperator.EXISTS:
            return value is not None
        if op is SelectorOperator.DOES_NOT_EXIST:
            return value is None
        if value is None or not re.fullmatch(r"-?\d+", value):
            return False
        bound = int(self.values[0])
        return int(value) > bound if op is SelectorOperator.GT else int(value) < bound

    def describe(self) -> str:
        if self.operator in (SelectorOperator.EXISTS, SelectorOperator.DOES_NOT_EXIST):
            return f"{self.key} {self.operator.value}"
        if self.operator in (SelectorOperator.GT, SelectorOperator.LT):
            return f"{self.key} {self.operator.value} {self.values[0]}"
        return f"{self.key} {self.operator.value} [{', '.join(self.values)}]"


class NodeSelectorTerm(Frozen):
    """Requirements that must all hold (ANDed). As in Kubernetes, a term without any requirement matches no node.
    `match_fields` may only name `metadata.name` (the node's name)."""

    match_expressions: tuple[NodeSelectorRequirement, ...] = ()
    match_fields: tuple[NodeSelectorRequirement, ...] = ()

    @field_validator("match_fields")
    @classmethod
    def _node_name_only(cls, v: tuple[NodeSelectorRequirement, ...]) -> tuple[NodeSelectorRequirement, ...]:
        bad = sorted({r.key for r in v if r.key != NODE_NAME_FIELD})
        if bad:
            raise ValueError(f"match_fields may only name {NODE_NAME_FIELD}, not {', '.join(bad)}")
        return v

    def matches(self, labels: Mapping[str, str], node_name: str) -> bool:
        if not self.match_expressions and not self.match_fields:
            return False
        fields = {NODE_NAME_FIELD: node_name}
        return (all(r.matches(labels) for r in self.match_expressions)
                and all(r.matches(fields) for r in self.match_fields))

    def describe(self) -> str:
        parts = [r.describe() for r in (*self.match_expressions, *self.match_fields)]
        return " and ".join(parts) if parts else "(empty term: matches no node)"


class PreferredSchedulingTerm(Frozen):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(Frozen):
    """A pod set's node affinity. `required`: terms ORed (Kubernetes' requiredDuringSchedulingIgnoredDuringExecution;
    empty = no requirement); `preferred`: weighted terms, a node's score is the sum of the weights of the terms it
    matches (preferredDuringSchedulingIgnoredDuringExecution)."""

    required: tuple[NodeSelectorTerm, ...] = ()
    preferred: tuple[PreferredSchedulingTerm, ...] = ()

    def required_matches(self, labels: Mapping[str, str], node_name: str) -> bool:
        return not self.required or any(t.matches(labels, node_name) for t in self.required)

    def score(self, labels: Mapping[str, str], node_name: str) -> int:
        return sum(p.weight for p in self.preferred if p.preference.matches(labels, node_name))

    def describe_required(self) -> str:
        terms = [t.describe() for t in self.required]
        return terms[0] if len(terms) == 1 else " or ".join(f"({t})" for t in terms)


class WorkloadRef(Frozen):
    """The Kubernetes object a job came from (a suspended Job, JobSet, PyTorchJob or RayJob)."""

    api_version: str = Field(min_length=1)
    kind: str = Field(min_length=1)
    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)
    uid: str | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"


# Where an environment variable may take its value from instead of `value` (Kubernetes' EnvVarSource).
ENV_SOURCES = ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef")


class EnvVar(Frozen):
    """One environment variable: a `value`, or `value_from` one of ENV_SOURCES, written as Kubernetes writes it
    (`{"secretKeyRef": {"name": "db", "key": "uri"}}`); a Secret is named by reference, never copied in."""

    name: str = Field(min_length=1)
    value: str = ""
    value_from: dict[str, Any] | None = Field(default=None, exclude_if=unset)  # added since v1

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value_from is None:
            return self
        if self.value:
            raise ValueError(f"env {self.name}: value and value_from are exclusive")
        keys = sorted(self.value_from)
        if len(keys) != 1 or keys[0] not in ENV_SOURCES or not isinstance(self.value_from[keys[0]], dict):
            raise ValueError(f"env {self.name}: value_from names exactly one of {', '.join(ENV_SOURCES)}")
        return self


class PodTemplate(Frozen):
    """What Kubernetes needs to run one pod of an event-submitted job. Resources (GPUs, MIG slice, CPU, memory)
    come from the pod set; `resources` adds other limits (e.g. `ephemeral-storage`). `volumes` and
    `volume_mounts` are Kubernetes Volume / VolumeMount objects, passed through as written."""

    image: str = Field(min_length=1)
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = ()
    resources: dict[str, str] = Field(default_factory=dict)
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    service_account_name: str | None = None
    termination_grace_period_s: int | None = Field(default=None, ge=0)
    # The user id its containers run as (never root): for an image whose own user is root, which the `restricted`
    # Pod Security profile (runAsNonRoot) would not start.
    run_as_user: int | None = Field(default=None, ge=1, exclude_if=unset)  # added since v1


class SharingMode(StrEnum):
    """How several pods share one GPU (docs/scheduler.md, "Sharing GPUs"). TIME_SLICING: the device plugin's
    time-slicing replicas (`nvidia.com/gpu` or the renamed `nvidia.com/gpu.shared`): the pods take turns, with no
    isolation of memory or faults. MPS: the device plugin's MPS sharing, each client limited to a share of the
    threads (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and of the memory. A GPU shared one way is never used the other way."""

    TIME_SLICING = "time-slicing"
    MPS = "mps"


MIN_SHARE_MILLI = 1  # the smallest compute share a pod may ask, in milli-GPUs


class PodSet(Frozen):
    name: str = "main"
    count: int = Field(default=1, ge=1, le=4096)
    gpus_per_pod: int = Field(default=1, ge=0, le=64)
    gpu_models: tuple[str, ...] = ()  # any-of; empty = any model
    mig_profile: str | None = None  # e.g. "1g.10gb": each pod takes one slice of this profile
    cpu_milli: int = Field(default=1000, ge=0)
    memory_mib: int = Field(default=4096, ge=0)
    template: PodTemplate | None = None  # how to run it, for a job submitted as an event (Kubernetes executor)
    # Where its pods may run (Kubernetes' nodeSelector, node affinity and tolerations of the pod template): the
    # scheduler places them only on nodes whose labels match and whose taints they (or the job) tolerate.
    node_selector: dict[str, str] = Field(default_factory=dict, exclude_if=unset)  # these three: added since v1
    affinity: NodeAffinity | None = Field(default=None, exclude_if=unset)
    tolerations: tuple[Toleration, ...] = Field(default=(), exclude_if=unset)
    # Part of one GPU (these three: added since v1). `gpu_fraction` (0 < x < 1): the share of one GPU's compute each
    # pod needs, counted in milli-GPUs (`share_milli`); `gpu_memory_mib`: the GPU memory each pod needs on the GPU it
    # shares; `gpu_sharing`: the isolation it needs (None: whichever the node offers). A pod set with a fraction or a
    # GPU memory request shares a GPU (`shared`): it takes no whole GPU (`gpus` counts 0), one pod per GPU slot of a
    # node whose GPUs are shared (NodeSpec.sharing). A job file may write `gpus_per_pod: 0.25` for the fraction.
    gpu_fraction: float | None = Field(default=None, exclude_if=unset)
    gpu_memory_mib: int | None = Field(default=None, exclude_if=unset)
    gpu_sharing: SharingMode | None = Field(default=None, exclude_if=unset)
    # Elastic (added since v1): the pod set runs with `min_count`..`count` pods. It starts with as many as fit (at
    # least min_count), grows into idle GPUs and is shrunk back towards min_count before anyone is preempted
    # (docs/scheduler.md "Elastic jobs"). None: a fixed pod set of `count` pods. Whole-GPU pods only.
    min_count: int | None = Field(default=None, ge=1, le=4096, exclude_if=unset)

    @model_validator(mode="before")
    @classmethod
    def _fraction_as_gpus(cls, data: Any) -> Any:
        """`gpus_per_pod: 0.25` (a job file, the CLI's --gpus 0.25) means one shared GPU slot, gpu_fraction 0.25."""
        if isinstance(data, dict):
            gpus = data.get("gpus_per_pod")
            if (isinstance(gpus, float) and 0 < gpus < 1 and data.get("gpu_fraction") is None
                    and not data.get("mig_profile")):
                data = {**data, "gpus_per_pod": 1, "gpu_fraction": gpus}
        return data

    @model_validator(mode="after")
    def _mig_pods_take_one_slice(self) -> PodSet:
        if self.mig_profile is not None and self.gpus_per_pod not in (0, 1):
            raise ValueError("a pod with mig_profile takes exactly one slice: set gpus_per_pod to 1")
        return self

    @model_validator(mode="after")
    def _shared_pods_take_one_gpu(self) -> PodSet:
        name = f"pod set {self.name}"
        if self.gpu_fraction is not None:
            f = self.gpu_fraction
            if not (0 < f < 1) or f != f:
                raise ValueError(f"{name}: gpu_fraction must be above 0 and below 1 (a share of one GPU), got {f!r}; "
                                 "for whole GPUs set gpus_per_pod")
            if round(f * MILLI_GPU) < MIN_SHARE_MILLI or round(f * MILLI_GPU) >= MILLI_GPU:
                raise ValueError(f"{name}: gpu_fraction {f!r} rounds to {round(f * MILLI_GPU)} milli-GPUs: "
                                 f"it must be between 0.001 and 0.999")
        if self.gpu_memory_mib is not None and self.gpu_memory_mib < 1:
            raise ValueError(f"{name}: gpu_memory_mib must be at least 1 MiB, got {self.gpu_memory_mib}")
        if self.gpu_sharing is not None and not self.shared:
            raise ValueError(f"{name}: gpu_sharing needs gpu_fraction or gpu_memory_mib (the part of a GPU to share)")
        if self.shared:
            field = "gpu_fraction" if self.gpu_fraction is not None else "gpu_memory_mib"
            if self.mig_profile is not None:
                raise ValueError(f"{name}: {field} and mig_profile are exclusive (a MIG slice is not shared)")
            if self.gpus_per_pod != 1:
                raise ValueError(f"{name}: {field} shares one GPU per pod: set gpus_per_pod to 1, "
                                 f"got {self.gpus_per_pod}")
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> PodSet:
        if self.min_count is not None:
            if self.min_count > self.count:
                raise ValueError(f"pod set {self.name}: min_count={self.min_count} exceeds count={self.count} "
                                 "(count is the most pods it runs)")
            if self.mig_profile is not None or self.shared or self.gpus_per_pod == 0:
                raise ValueError(f"pod set {self.name}: min_count (elastic) needs whole-GPU pods")
        return self

    @property
    def floor(self) -> int:
        """The fewest pods it runs with: min_count for an elastic pod set, count otherwise."""
        return self.min_count if self.min_count is not None else self.count

    @property
    def elastic(self) -> bool:
        return self.floor < self.count

    @model_validator(mode="after")
    def _selectors_agree(self) -> PodSet:
        if self.template is not None:
            clash = sorted(k for k, v in self.template.node_selector.items() if self.node_selector.get(k, v) != v)
            if clash:
                raise ValueError(f"pod set {self.name}: node_selector and template.node_selector disagree on "
                                 f"{', '.join(clash)}")
        return self

    @property
    def selector(self) -> dict[str, str]:
        """The labels every node of this pod set must carry: its node_selector and its template's."""
        if self.template is None or not self.template.node_selector:
            return self.node_selector
        return {**self.template.node_selector, **self.node_selector}

    @property
    def own_tolerations(self) -> tuple[Toleration, ...]:
        """Tolerations of this pod set alone (its own and its template's), on top of the job's."""
        if self.template is None or not self.template.tolerations:
            return self.tolerations
        return self.tolerations + tuple(t for t in self.template.tolerations if t not in self.tolerations)

    @property
    def gpus(self) -> int:
        """Whole GPUs this pod set asks for (MIG pods and pods sharing a GPU count as 0 whole GPUs)."""
        return 0 if self.mig_profile or self.shared else self.count * self.gpus_per_pod

    @property
    def shared(self) -> bool:
        """Whether its pods share a GPU (they ask a fraction of one, or GPU memory on one)."""
        return self.gpu_fraction is not None or self.gpu_memory_mib is not None

    @property
    def share_milli(self) -> int:
        """Compute share of one pod in milli-GPUs: its gpu_fraction (rounded to the milli-GPU); a pod asking only GPU
        memory counts 0 here and takes what the node gives it (`shared_share_milli`); 0 for a pod not sharing."""
        return round(self.gpu_fraction * MILLI_GPU) if self.gpu_fraction is not None else 0

    @property
    def mig_slices(self) -> int:
        return self.count if self.mig_profile else 0


class TopologyRequest(Frozen):
    required_level: TopologyLevel | None = None
    preferred_level: TopologyLevel | None = None

    @model_validator(mode="after")
    def _one_of(self) -> TopologyRequest:
        if self.required_level is not None and self.preferred_level is not None:
            raise ValueError("set either required_level or preferred_level, not both")
        return self


class CheckpointSpec(Frozen):
    supported: bool = False
    interval_s: int | None = Field(default=None, ge=1)


# Exit reasons (shared.events.ExitReason values; the domain cannot import the events) a retry policy may name,
# and the ones it retries unless it says otherwise. Kubernetes' batch/v1 Job retries every pod failure up to
# `backoffLimit`; its `podFailurePolicy` is how users stop retrying failures a retry cannot cure, and Kueue's own
# requeueing covers evictions and nodes that fail. gpuq's default rule does both: NodeFailure, Evicted and Error
# (a crash that may be transient) are retried; OOMKilled (the same job runs out of memory again), ImagePullFailed
# (the image will not appear by waiting), DeadlineExceeded (it would run past its limit again) and PodsNotReady
# (the executor already requeued it up to its own limit) are not, unless the policy names them.
RETRYABLE_REASONS: tuple[str, ...] = ("OOMKilled", "Error", "DeadlineExceeded", "NodeFailure", "Evicted",
                                      "ImagePullFailed", "PodsNotReady")
DEFAULT_RETRY_ON: tuple[str, ...] = ("Error", "NodeFailure", "Evicted")
# Never retried: a cancel is the user's last word, and a job declared Lost by the scheduler's liveness watch has no
# executor left that could count its attempts.
NEVER_RETRIED: tuple[str, ...] = ("Succeeded", "Cancelled", "Lost")


class RetryPolicy(Frozen):
    """What to do when an attempt of the job fails (Kubernetes' Job `backoffLimit` with a `podFailurePolicy`-like
    rule). A failed attempt whose exit reason is in `reasons` is retried while fewer than `backoff_limit` retries were
    made: the job waits `min(backoff_s * 2^(n-1), max_backoff_s)` before its n-th retry (the Job controller's
    10 s doubled, capped at 6 minutes), then goes through admission and placement again, resuming from its last
    checkpoint if it has one. `backoff_limit` 0 (the default here; Kubernetes' default is 6) keeps a failed
    attempt final."""

    backoff_limit: int = Field(default=0, ge=0, le=100)
    backoff_s: float = Field(default=10.0, ge=0, le=86_400)
    max_backoff_s: float = Field(default=360.0, ge=0, le=7 * 86_400)
    reasons: tuple[str, ...] = DEFAULT_RETRY_ON

    @field_validator("reasons")
    @classmethod
    def _known_reasons(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        never = sorted({r for r in v if r in NEVER_RETRIED})
        if never:
            raise ValueError(f"retry.reasons cannot name {', '.join(never)}: such an end is never retried "
                             f"(retryable: {', '.join(RETRYABLE_REASONS)})")
        unknown = sorted({r for r in v if r not in RETRYABLE_REASONS})
        if unknown:
            raise ValueError(f"retry.reasons names unknown exit reason(s) {', '.join(unknown)} "
                             f"(retryable: {', '.join(RETRYABLE_REASONS)})")
        return tuple(sorted(set(v)))

    @model_validator(mode="after")
    def _cap_covers_base(self) -> RetryPolicy:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"retry.max_backoff_s ({self.max_backoff_s:g}) is below retry.backoff_s "
                             f"({self.backoff_s:g}): the cap must be at least the first backoff")
        return self


class JobSpec(Frozen):
    """What a user asks for. The scheduler knows only this and `max_runtime_s`, never the true duration."""

    job_id: str
    team: str
    queue: str
    priority_class: str = "normal"
    kind: JobKind = JobKind.TRAINING
    pod_sets: tuple[PodSet, ...] = Field(min_length=1, max_length=16)
    min_members: int | None = Field(default=None, ge=1)
    topology: TopologyRequest = TopologyRequest()
    tolerations: tuple[Toleration, ...] = ()
    datasets: tuple[str, ...] = ()
    checkpoint: CheckpointSpec = CheckpointSpec()
    max_runtime_s: int = Field(default=86_400, ge=1)
    labels: dict[str, str] = Field(default_factory=dict)
    preemptible: bool | None = None  # None = the priority class decides
    user: str | None = None
    # Kubernetes: the workload object a job came from, or the namespace an event-submitted job runs in
    # (default: the namespace queues.yaml maps to the team). A job has a workload or pod templates, not both.
    workload: WorkloadRef | None = None
    namespace: str | None = None
    # Retries of failed attempts (RetryPolicy). None: a failed attempt is final, as before retries existed.
    retry: RetryPolicy | None = None

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any, info: ValidationInfo) -> Any:
        return refuse_unstorable(data, info)

    @field_validator("job_id")
    @classmethod
    def _job_id_shape(cls, v: str) -> str:
        if not JOB_ID_RE.match(v):
            raise ValueError("job_id must be 1-192 characters of letters, digits, '.', '_', ':' or '-'")
        return v

    @field_validator("team", "queue", "priority_class")
    @classmethod
    def _names(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid name (lower-case letters, digits, '.', '_', '-')")
        return v

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        names = [p.name for p in self.pod_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"pod set names must be unique, got {names}")
        if self.min_members is not None and self.min_members > self.total_pods:
            raise ValueError(f"min_members={self.min_members} exceeds the job's {self.total_pods} pods")
        if self.min_members is not None and self.elastic:
            raise ValueError("an elastic job (a pod set with min_count) cannot also set min_members: "
                             "its pod sets' min_count is its gang")
        templated = [p.name for p in self.pod_sets if p.template is not None]
        if self.workload is not None and templated:
            raise ValueError("a job from a Kubernetes workload cannot also carry pod templates "
                             f"(pod sets {', '.join(templated)})")
        if templated and len(templated) != len(self.pod_sets):
            missing = [p.name for p in self.pod_sets if p.template is None]
            raise ValueError(f"every pod set needs a template when one has one; missing: {', '.join(missing)}")
        return self

    @property
    def runnable(self) -> bool:
        """Whether Kubernetes can run it: it names its workload object or carries a template per pod set."""
        return self.workload is not None or all(p.template is not None for p in self.pod_sets)

    @property
    def total_pods(self) -> int:
        return sum(p.count for p in self.pod_sets)

    @property
    def gang_size(self) -> int:
        """Pods that must start together: min_members, an elastic job's min_pods, else every pod."""
        return self.min_members if self.min_members is not None else self.min_pods

    @property
    def elastic(self) -> bool:
        """Whether a pod set runs with fewer pods than `count` (PodSet.min_count)."""
        return any(p.elastic for p in self.pod_sets)

    @property
    def min_pods(self) -> int:
        """The fewest pods an elastic job runs with (the sum of its pod sets' floors; total_pods when fixed)."""
        return sum(p.floor for p in self.pod_sets)

    def at_pods(self, pods: int) -> JobSpec:
        """This job with `pods` pods in all (min_pods..total_pods): its elastic pod sets keep their floors and the
        pods above them go to the elastic pod sets in pod-set order; the result is a fixed job (no min_count), the
        shape the placer places and quota charges. `self` when fixed or at total_pods."""
        if not self.elastic or pods >= self.total_pods:
            return self
        extra = max(0, pods - self.min_pods)
        sets = []
        for p in self.pod_sets:
            grow = min(extra, p.count - p.floor)
            extra -= grow
            sets.append(p.model_copy(update={"count": p.floor + grow, "min_count": None}))
        return self.model_copy(update={"pod_sets": tuple(sets), "min_members": None})

    @property
    def total_gpus(self) -> int:
        return sum(p.gpus for p in self.pod_sets)

    @property
    def total_mig_slices(self) -> int:
        return sum(p.mig_slices for p in self.pod_sets)

    @property
    def total_share_milli(self) -> int:
        """Milli-GPUs of compute its pods sharing a GPU ask for (their gpu_fraction; 0 when none shares)."""
        return sum(p.count * p.share_milli for p in self.pod_sets)

    @property
    def total_gpu_memory_mib(self) -> int:
        """GPU memory its pods sharing a GPU ask for (their gpu_memory_mib)."""
        return sum(p.count * (p.gpu_memory_mib or 0) for p in self.pod_sets)

    @property
    def gpu_models(self) -> tuple[str, ...]:
        """Models acceptable to every pod set (intersection of any-of lists; empty = any)."""
        acceptable: list[str] | None = None
        for p in self.pod_sets:
            if not p.gpu_models:
                continue
            acceptable = list(p.gpu_models) if acceptable is None else [m for m in acceptable if m in p.gpu_models]
        return tuple(acceptable or ())


class NodeHealth(StrEnum):
    """Only READY nodes take new placements. DEGRADED: the GPU health checks (DCGM XID errors, a GPU fallen off
    the bus) found a fault; jobs already there run on, nothing new is placed until the fault clears."""

    READY = "ready"
    CORDONED = "cordoned"
    FAILED = "failed"
    DEGRADED = "degraded"


class Precision(StrEnum):
    """Numeric formats a GPU's peak throughput is quoted in (gpu_flavors.*.peak_tflops) and a job reports its
    achieved FLOP/s in (MFU)."""

    FP64 = "fp64"
    TF32 = "tf32"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    FP4 = "fp4"


MILLI_GPU = 1000  # a whole GPU in milli-GPUs, the unit GPU shares are counted in
MIG_COMPUTE_SLICES = 7  # A100/H100 GPUs have 7 compute slices; a `3g.40gb` slice is 3/7 of a GPU
_MIG_PROFILE_RE = re.compile(r"^(\d+)g\.")


def mig_milli_gpus(profile: str | None) -> int:
    """GPU share of one MIG slice of `profile` (`1g.10gb` → 142 milli-GPUs); unknown shapes count as 1g."""
    m = _MIG_PROFILE_RE.match(profile or "")
    compute = int(m.group(1)) if m else 1
    return min(MILLI_GPU, compute * MILLI_GPU // MIG_COMPUTE_SLICES)


class MigLayout(Frozen):
    profile: str
    slices_per_gpu: int = Field(ge=1, le=7)


class GpuSharing(Frozen):
    """How a node shares its GPUs between pods (GFD: `nvidia.com/gpu.replicas`, `nvidia.com/mps.capable`).

    `replicas`: pods per GPU the device plugin advertises (at least 2), a cap of pods on one GPU; `resource`: the
    extended resource a shared pod asks for (`nvidia.com/gpu`, or `nvidia.com/gpu.shared` when the device plugin
    renames it); `gpu_memory_mib`: the memory of one GPU (0 = unknown: GPU memory requests cannot be checked there,
    and such pods are not placed); `shared_gpus`: how many of the node's GPUs are shared (None = all; the others, the
    highest indices, stay whole GPUs for pods that ask whole GPUs)."""

    mode: SharingMode
    replicas: int = Field(ge=2, le=1024)
    resource: str = Field(default="nvidia.com/gpu", min_length=1)
    gpu_memory_mib: int = Field(default=0, ge=0)
    shared_gpus: int | None = Field(default=None, ge=0)


class NodeUsage(Frozen):
    """What pods hold on a node, in the units the scheduler counts: whole GPUs, slices of the node's MIG profile,
    milli-CPU, MiB of memory; and how many pods hold them."""

    gpus: int = Field(default=0, ge=0)
    mig_slices: int = Field(default=0, ge=0)
    cpu_milli: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)
    pods: int = Field(default=0, ge=0)


NO_USAGE = NodeUsage()


class PodShape(Frozen):
    """What one pod asks of a node: whole GPUs or one slice of a MIG profile, CPU, memory."""

    gpus: int = Field(default=0, ge=0)
    mig_profile: str | None = None
    cpu_milli: int = Field(default=0, ge=0)
    memory_mib: int = Field(default=0, ge=0)

    @classmethod
    def of(cls, ps: PodSet) -> PodShape:
        """The shape of one pod of `ps` (a MIG pod asks one slice, a pod sharing a GPU no whole GPU)."""
        return cls(gpus=0 if ps.mig_profile or ps.shared else ps.gpus_per_pod, mig_profile=ps.mig_profile,
                   cpu_milli=ps.cpu_milli, memory_mib=ps.memory_mib)

    def covers(self, gpus: int, mig_profile: str | None, cpu_milli: int, memory_mib: int) -> bool:
        """Whether a pod asking this much is at least this shape: what refused this shape refuses it too."""
        return (mig_profile == self.mig_profile and gpus >= self.gpus and cpu_milli >= self.cpu_milli
                and memory_mib >= self.memory_mib)

    def describe(self) -> str:
        what = f"1 {self.mig_profile} slice" if self.mig_profile else f"{self.gpus} GPU(s)"
        return f"{what}, {self.cpu_milli}m CPU, {self.memory_mib} MiB"


class PlacementRefusal(Frozen):
    """A node refused a pod gpuq placed there (kube-scheduler left it unschedulable, or the kubelet rejected it):
    the scheduler places no pod of this shape or larger there while the node's usage is what it was then (`usage`:
    what its other pods held, the refused job's own pods left out)."""

    shape: PodShape
    reason: str  # e.g. OutOfnvidia.com/gpu, UnexpectedAdmissionError, NodeAffinity, Unschedulable
    message: str = ""
    job_id: str
    usage: NodeUsage = NO_USAGE


class NodeSpec(Frozen):
    """One node as the scheduler sees it (from cluster.yaml, NodeInventory or the Kubernetes API).

    `held`: what pods gpuq does not manage hold there (on Kubernetes: another scheduler's pods, a DaemonSet's, an
    inference Deployment's), which the scheduler does not place onto: capacity minus `held` is what gpuq has.
    `refused`: pod shapes the node refused since its usage last changed (the executor keeps them current), which the
    scheduler does not place there."""

    name: str
    gpus: int = Field(ge=0)
    gpu_model: str
    cpu_milli: int = Field(ge=0)
    memory_mib: int = Field(ge=0)
    mig: MigLayout | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    health: NodeHealth = NodeHealth.READY
    rack: str
    block: str
    datasets: tuple[str, ...] = ()
    held: NodeUsage = Field(default=NO_USAGE, exclude_if=lambda v: v == NO_USAGE)  # these two: added since v1
    refused: tuple[PlacementRefusal, ...] = Field(default=(), exclude_if=unset)
    # GPU sharing and mixed MIG (these two: added since v1). `sharing`: its GPUs (all, or `sharing.shared_gpus` of
    # them) take pods asking part of a GPU. `mig_profiles`: the MIG strategy `mixed`, the slices per profile the node
    # advertises (`nvidia.com/mig-<profile>`), beside `gpus` whole GPUs that are not partitioned (a node with the
    # single strategy uses `mig` instead; the two are exclusive).
    sharing: GpuSharing | None = Field(default=None, exclude_if=unset)
    mig_profiles: dict[str, int] = Field(default_factory=dict, exclude_if=unset)

    @model_validator(mode="after")
    def _sharing_fits(self) -> NodeSpec:
        if self.mig is not None and self.mig_profiles:
            raise ValueError(f"node {self.name}: mig (the single strategy) and mig_profiles (mixed) are exclusive")
        bad = sorted(p for p, n in self.mig_profiles.items() if n < 0 or not _MIG_PROFILE_RE.match(p))
        if bad:
            raise ValueError(f"node {self.name}: mig_profiles: {', '.join(shown(p) for p in bad)}: a profile is "
                             "named like 1g.10gb and has 0 or more slices")
        if self.sharing is not None:
            if self.mig is not None:
                raise ValueError(f"node {self.name}: sharing and mig are exclusive (a MIG node shares by slices)")
            if self.sharing.shared_gpus is not None and self.sharing.shared_gpus > self.gpus:
                raise ValueError(f"node {self.name}: sharing.shared_gpus={self.sharing.shared_gpus} exceeds its "
                                 f"{self.gpus} GPUs")
        return self

    @property
    def shared_gpus(self) -> int:
        """How many of its GPUs are shared (the lowest indices): 0 without sharing."""
        if self.sharing is None:
            return 0
        return self.gpus if self.sharing.shared_gpus is None else self.sharing.shared_gpus

    def refuses(self, gpus: int, mig_profile: str | None, cpu_milli: int, memory_mib: int) -> PlacementRefusal | None:
        """The refusal that covers a pod of this shape, if any."""
        return next((r for r in self.refused if r.shape.covers(gpus, mig_profile, cpu_milli, memory_mib)), None)

    def domain(self, level: TopologyLevel) -> str:
        if level is TopologyLevel.NODE:
            return self.name
        if level is TopologyLevel.RACK:
            return self.rack
        return self.block


class GpuBinding(Frozen):
    """Where one pod runs: node, whole-GPU indices, one MIG slice, or part of one shared GPU.

    `mig_slice`: (gpu index, slice index) on a node with one MIG profile (`NodeSpec.mig`); on a mixed-MIG node
    (`NodeSpec.mig_profiles`) it is (the profile's index in the sorted profile names, slice number among that
    profile's slices): gpuq's bookkeeping only, the device plugin picks the real instance. Part of a shared GPU:
    `shared_gpu` its index on the node, `share_milli` the compute share it holds there in milli-GPUs (its
    gpu_fraction; a pod asking only GPU memory holds its memory's part of the GPU, at least 1), `gpu_memory_mib` the
    GPU memory it holds there (None: none asked), `sharing` the node's mode (which isolation the executor sets up)."""

    pod: str  # "<pod_set>-<index>"
    node: str
    gpu_indices: tuple[int, ...] = ()
    mig_slice: tuple[int, int] | None = None
    shared_gpu: int | None = Field(default=None, ge=0, exclude_if=unset)  # these four: added since v1
    share_milli: int | None = Field(default=None, ge=1, le=MILLI_GPU, exclude_if=unset)
    gpu_memory_mib: int | None = Field(default=None, ge=0, exclude_if=unset)
    sharing: SharingMode | None = Field(default=None, exclude_if=unset)

    @model_validator(mode="after")
    def _one_kind(self) -> GpuBinding:
        if self.shared_gpu is not None and (self.gpu_indices or self.mig_slice is not None):
            raise ValueError(f"binding {self.pod}: shared_gpu excludes gpu_indices and mig_slice")
        if (self.shared_gpu is None) != (self.share_milli is None):
            raise ValueError(f"binding {self.pod}: shared_gpu and share_milli go together")
        return self


def binding_milli_gpus(binding: GpuBinding, spec: JobSpec) -> int:
    """Milli-GPUs one pod binding holds: whole GPUs ×1000, the MIG share of its pod set's profile, or the share of a
    shared GPU it holds."""
    if binding.gpu_indices:
        return len(binding.gpu_indices) * MILLI_GPU
    if binding.share_milli is not None:
        return binding.share_milli
    if binding.mig_slice is not None:
        pod_set = binding.pod.rsplit("-", 1)[0]
        profile = next((p.mig_profile for p in spec.pod_sets if p.name == pod_set), None)
        if profile is None:  # pod name not in the spec: take the job's only MIG profile, if there is one
            profiles = sorted({p.mig_profile for p in spec.pod_sets if p.mig_profile})
            profile = profiles[0] if profiles else None
        return mig_milli_gpus(profile)
    return 0


def node_shares(bindings: tuple[GpuBinding, ...] | list[GpuBinding], spec: JobSpec) -> tuple[tuple[str, int], ...]:
    """Milli-GPUs per node of a placement, sorted by node name; nodes holding no GPU are left out."""
    per_node: dict[str, int] = {}
    for b in bindings:
        per_node[b.node] = per_node.get(b.node, 0) + binding_milli_gpus(b, spec)
    return tuple((node, milli) for node, milli in sorted(per_node.items()) if milli > 0)
