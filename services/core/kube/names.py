"""gpuq's labels, annotations, gates and environment variables on Kubernetes objects (docs/kubernetes.md)."""

from __future__ import annotations

import hashlib
import re

QUEUE_LABEL = "gpuq.io/queue"  # on a workload: the queue it asks for (intake)
PRIORITY_LABEL = "gpuq.io/priority-class"  # on a workload: gpuq priority class
JOB_LABEL = "gpuq.io/job"  # on pod templates and pods: a hash of the job id (label values are short)
POD_SET_LABEL = "gpuq.io/pod-set"  # on pod templates and pods: the pod set

JOB_ID_ANNOTATION = "gpuq.io/job-id"  # the full job id, on workloads and pods
STATUS_ANNOTATION = "gpuq.io/status"  # on a workload: where it stands, kept current
# On a workload: the user of record, written by gpuq's admission webhook from the request's userInfo (a value the
# author writes or changes is refused there); the intake believes it only where that webhook runs.
USER_ANNOTATION = "gpuq.io/user"
CHECKPOINT_ANNOTATION = "gpuq.io/checkpoint"  # on a workload: "true" when the job can checkpoint
CHECKPOINT_INTERVAL_ANNOTATION = "gpuq.io/checkpoint-interval-s"
MAX_RUNTIME_ANNOTATION = "gpuq.io/max-runtime-s"  # runtime limit when activeDeadlineSeconds is not set
MIN_MEMBERS_ANNOTATION = "gpuq.io/min-members"
TOPOLOGY_REQUIRED_ANNOTATION = "gpuq.io/topology-required"  # rack | block
TOPOLOGY_PREFERRED_ANNOTATION = "gpuq.io/topology-preferred"
GPU_MODELS_ANNOTATION = "gpuq.io/gpu-models"  # comma-separated flavors (any of)
DATASETS_ANNOTATION = "gpuq.io/datasets"
KIND_ANNOTATION = "gpuq.io/kind"  # training | inference | notebook
# A LeaderWorkerSet held at zero groups: the groups to run when gpuq starts it (kinds/leaderworkerset.py)
GROUPS_ANNOTATION = "gpuq.io/groups"
# A StatefulSet held at 0 replicas: the pods to run when gpuq starts it (kinds/statefulset.py)
REPLICAS_ANNOTATION = "gpuq.io/replicas"
PREEMPTIBLE_ANNOTATION = "gpuq.io/preemptible"
# Plain pods (kinds/pod.py): pods sharing this label in a namespace form one gang job of as many pods as the annotation
# says, admitted once they all exist (Kueue's kueue.x-k8s.io/pod-group-name and pod-group-total-count).
POD_GROUP_LABEL = "gpuq.io/pod-group"
POD_GROUP_TOTAL_ANNOTATION = "gpuq.io/pod-group-total-count"
# A workload's retry policy (JobSpec.retry): failures gpuq observes on a live workload are retried through
# admission after a backoff. (A workload Kubernetes itself marks Failed is final: its own backoffLimit retried it.)
RETRY_BACKOFF_LIMIT_ANNOTATION = "gpuq.io/retry-backoff-limit"
RETRY_BACKOFF_S_ANNOTATION = "gpuq.io/retry-backoff-s"  # base of the exponential backoff, seconds
RETRY_REASONS_ANNOTATION = "gpuq.io/retry-reasons"  # comma-separated exit reasons (default: Error,NodeFailure,Evicted)

CHECKPOINT_REQUESTED_ANNOTATION = "gpuq.io/checkpoint-requested"  # on pods: the deadline (RFC 3339)
# On an elastic workload and its pods: the pods the job runs with now (gpuq_sdk.target_pods), written when gpuq starts,
# grows or shrinks it; `<pod set>=<pods>` per elastic pod set in TARGET_PODS_BY_SET_ANNOTATION.
TARGET_PODS_ANNOTATION = "gpuq.io/target-pods"
TARGET_PODS_BY_SET_ANNOTATION = "gpuq.io/target-pods-by-set"
LAST_CHECKPOINT_ANNOTATION = "gpuq.io/last-checkpoint"  # on a pod, set by the SDK: the checkpoint URI
LAST_CHECKPOINT_STEP_ANNOTATION = "gpuq.io/last-checkpoint-step"
RESUME_FROM_ANNOTATION = "gpuq.io/resume-from"  # on pod templates: the checkpoint to resume from

# On the pods of a pod set sharing GPUs (issue 47): the node's sharing mode (time-slicing | mps), and what isolation
# its pods have from the others on the same GPU, said in words (time-slicing has none).
GPU_SHARING_LABEL = "gpuq.io/gpu-sharing"
# How a workload's pods ask part of a GPU (on a pod template, else on the workload): the compute share (0 < x < 1),
# the GPU memory in MiB, and the isolation required (time-slicing | mps). Its containers ask one replica of the
# sharing resource (nvidia.com/gpu, or nvidia.com/gpu.shared where the device plugin renames it).
GPU_FRACTION_ANNOTATION = "gpuq.io/gpu-fraction"
GPU_MEMORY_ANNOTATION = "gpuq.io/gpu-memory-mib"
GPU_SHARING_ANNOTATION = "gpuq.io/gpu-sharing"
GPU_ISOLATION_ANNOTATION = "gpuq.io/gpu-isolation"
# MPS: the client's share of the GPU's threads (percent) and its pinned device memory limit ("0=<MiB>M").
MPS_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

# On the NodeSpec (not the Node) of a node whose GPUs are DRA devices: the driver. A workload created in the cluster
# asks device-plugin resources, which such a node does not advertise: its GPU pod sets are kept off it.
DRA_NODE_LABEL = "gpuq.io/dra-driver"

# gpuq's own taint on the spot nodes it announces (kubernetes.spot_selector; never written to the Node): only the jobs
# given its toleration at intake (preemptible, in a queue with spot_for_preemptible) are placed there.
SPOT_TAINT = "gpuq.io/spot"
PLACEMENT_GATE = "gpuq.io/placement"  # scheduling gate held until gpuq gives the pod its node
RESUME_ENV = "GPUQ_RESUME_FROM"
HOSTNAME_LABEL = "kubernetes.io/hostname"
GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"  # the device plugin's shared replicas, renamed (renameByDefault)
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

_DNS_INVALID = re.compile(r"[^a-z0-9-]+")


def job_label(job_id: str) -> str:
    """A label value for a job id (which may be longer than 63 characters or contain ':')."""
    return hashlib.blake2b(job_id.encode(), digest_size=10).hexdigest()


def dns_name(job_id: str, limit: int = 52) -> str:
    """A DNS-1123 name for an event-submitted job's workload: readable, unique through a short hash.
    (52 leaves room for the suffixes controllers append to pod names.)"""
    base = _DNS_INVALID.sub("-", job_id.lower()).strip("-") or "job"
    digest = hashlib.blake2b(job_id.encode(), digest_size=3).hexdigest()
    return f"{base[: limit - 7].rstrip('-')}-{digest}"


def cluster_job_id(namespace: str, name: str, uid: str) -> str:
    """The job id of a workload created in the cluster: readable, and unique across re-creations."""
    return f"{namespace}.{name}.{uid.replace('-', '')[:8]}"
