"""Value types of the placement core: what a decision returns and what a scheduling cycle consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.domain import GpuBinding, JobSpec


class Reason:
    """Machine reasons carried by every `Unplaceable` (stable strings: events and dashboards use them)."""

    NO_GPU_MODEL = "NoGpuModel"
    NO_MIG_SLICES = "NoMigSlices"
    # No shared GPU (NodeSpec.sharing) of the isolation asked has room for a pod asking part of a GPU.
    NO_SHARED_GPU = "NoSharedGpu"
    UNTOLERATED = "Untolerated"
    NO_MATCHING_NODE = "NoMatchingNode"  # no node's labels match a pod set's nodeSelector / required node affinity
    NO_READY_NODES = "NoReadyNodes"
    INSUFFICIENT_GPUS = "InsufficientGpus"
    INSUFFICIENT_CPU_MEMORY = "InsufficientCpuMemory"
    TOPOLOGY_UNSATISFIABLE = "TopologyUnsatisfiable"
    WAITING_FOR_RESERVATION = "WaitingForReservation"
    # The nodes that could hold it refused pods of its shape (NodeSpec.refused: kube-scheduler or the kubelet
    # turned a pod away there) and their usage has not changed since.
    PLACEMENT_REFUSED = "PlacementRefused"


class PlacementConflict(Exception):
    """`commit` found a GPU, slice, CPU or memory of the placement already taken (or the node gone/unready)."""


@dataclass(frozen=True)
class Placement:
    """Where every pod of a gang runs. Committed whole or not at all.

    `requests` holds (cpu_milli, memory_mib) per binding, in the same order, so that `commit`/`release`
    can account CPU and memory without the job spec. It is empty for placements rebuilt from bare
    bindings (then only GPUs are accounted); `ClusterState.make_placement` fills it from the spec.
    """

    job_id: str
    bindings: tuple[GpuBinding, ...]
    racks_spanned: int
    blocks_spanned: int
    gpus: int
    mig_slices: int
    requests: tuple[tuple[int, int], ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({b.node for b in self.bindings}))

    @property
    def nodes_spanned(self) -> int:
        return len({b.node for b in self.bindings})


@dataclass(frozen=True)
class Unplaceable:
    job_id: str
    reason: str
    message: str


@dataclass(frozen=True)
class PendingJob:
    """A job admitted and waiting for placement. The caller gives the order (admission order)."""

    spec: JobSpec
    allowed_models: tuple[str, ...] = ()  # flavors chosen by admission; empty = the job's own any-of list


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    expected_end: float  # started_at + max_runtime_s: the user's limit, never the true duration


@dataclass(frozen=True)
class Hold:
    """Capacity freed by preempting `victim`, held for the `preemptor` that asked for it until `until`: no other
    job is placed on it meanwhile. Without it the scheduler gave the freed GPUs to whichever admitted job came
    first in its order, often before the preemptor itself was admitted (admission admits it only once the
    preemption has released its quota), and the preemptor then waited for something unrelated to end."""

    preemptor: str
    victim: str  # or FREE_HOLD / HINT_HOLD + a job: capacity held for a defragmentation move, nobody stopped for it
    placement: Placement  # the victim's placement: the GPUs, slices, CPU and memory it gave back
    until: float

    def words(self) -> str:
        """What the capacity is held for, as a waiting job's message says it."""
        if self.victim.startswith(FREE_HOLD):
            return f"GPUs held for {self.preemptor} while defragmentation moves jobs to make room for it"
        if self.victim.startswith(HINT_HOLD):
            return f"the place defragmentation planned for {self.preemptor}, which it moved"
        return f"capacity held for {self.preemptor}, which preempted {self.victim} for it"


# The keys of holds made for a defragmentation move (services/scheduler/defrag.py): a gang's plan's GPUs that were
# free already, and the moved job's hint.
FREE_HOLD = "free:"
HINT_HOLD = "hint:"


@dataclass
class CycleResult:
    placed: list[Placement] = field(default_factory=list)
    reservations: dict[str, float] = field(default_factory=dict)  # job_id -> planned start (feeds ETA)
    unplaceable: list[Unplaceable] = field(default_factory=list)
