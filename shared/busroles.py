"""Who is who on the bus: the bus users (one per service, the Kubernetes executor, admins, a producer per team),
what each service publishes and consumes, what each may do to a stream's configuration, and the user and inbox a
`nats://` URL connects as.

Below both shared/bus.py, which declares the streams a connection may create or update (`stream_rights`) and
connects (`inbox_prefix_for`), and shared/natsauth.py, which turns these rights into the server's users and
permissions (docs/security.md). Plain data and text: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol
from urllib.parse import quote, unquote, urlsplit, urlunsplit


class Stream(Protocol):
    """What `stream_rights` reads of a stream's declaration (shared/bus.py `StreamDef`)."""

    @property
    def subjects(self) -> tuple[str, ...]: ...

    @property
    def owner(self) -> str: ...

TEAM_PREFIX = "producer-"
ADMIN = "admin"
KUBE = "kube"

# What each service publishes (subjects below the namespace), besides its dead letters and audit records. The
# owner of each fact: nobody else may publish it.
SERVICE_PUBLISHES: dict[str, tuple[str, ...]] = {
    # queue.config_changed: the versions of the queue configuration it records (their publication; the services
    # read the version in force from its read model, whoever published).
    "admission": ("job.rejected", "job.queued", "status.job.pending", "job.admitted", "job.requeued", "job.cancelled",
                  "preemption.requested", "queue.config_changed", "job.resize_admitted"),
    # job.failed only with exit_reason Lost: the liveness watch's verdict on a job no executor reports.
    # job.grow_requested, job.resized: an elastic job's growth asked of admission, and its resizes (issue 48)
    "scheduler": ("job.placed", "status.job.pending", "preemption.requested", "job.failed", "job.grow_requested",
                  "job.resized"),
    "preemption": ("job.checkpoint_requested", "job.preempted"),
    "metering": ("queue.usage_reported",),  # its read model of decayed usage per queue (fair share over time)
    # idle reclaim (services/telemetry/idle.py): a job idle past its grace is requeued through the preemption
    # protocol, or its cancel asked for (ended by its class's policy or its TTL); its warning is a fact the Kubernetes
    # executor shows on the workload
    "telemetry": ("preemption.requested", "job.cancel_requested.*", "job.idle_warned"),
    "executor": ("job.started", "job.completed", "job.failed", "job.attempt_failed", "job.checkpointed",
                 "utilization.sampled",
                 "utilization.source_checked", "node.inventory", "node.changed", "utilization.heartbeat"),
    "audit": (),
    # The API publishes what authenticated people ask for: submissions and cancels of any team (it checked the
    # caller's team), approvals and configuration changes (it checked the caller is an admin).
    "api": ("job.submitted.*", "job.cancel_requested.*", "job.approved", "queue.config_changed"),
}
# What each service consumes: the stream subject patterns (below the namespace) of its durable consumers, one each,
# named `<service>-<pattern's name>` (shared/bus.py `consumer_plan`; tests/unit/contracts/test_bus_permissions.py
# checks this against the services' handlers). Admission instances serving some cohorts add their suffix.
SERVICE_CONSUMES: dict[str, tuple[str, ...]] = {
    "admission": ("job.>", "queue.>"),
    "scheduler": ("job.>", "node.>", "queue.>", "utilization.>"),
    "preemption": ("job.>", "preemption.>", "queue.>"),
    "metering": ("job.>", "queue.>", "utilization.>"),
    "telemetry": ("job.>", "node.>", "queue.>", "utilization.>", "status.>"),
    "executor": ("job.>",),
    "audit": ("audit.>",),
    "api": (),
    # The Kubernetes executor also follows waiting jobs' status (its workloads' conditions); its durables are named
    # as the executor's.
    "kube": ("job.>", "queue.>", "status.>"),
}
# The Kubernetes executor is an executor and also a trusted producer: workloads created in a namespace become that
# namespace's team's submissions (queues.yaml `namespaces`), deleted ones cancel requests.
KUBE_RECORDS_AS = "executor"
SERVICES = tuple(SERVICE_PUBLISHES)



def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def _role(user: str) -> str | None:
    """The service whose facts, consumers and streams a bus user has (the Kubernetes executor's: the executor's);
    None for admins, teams and users gpuq does not know."""
    if user == KUBE:
        return KUBE_RECORDS_AS
    return user if user in SERVICE_PUBLISHES else None


def _published(user: str, ns: str, kube_teams: Iterable[str] | None = None) -> list[str]:
    """The subjects a service's bus user publishes: its facts, its dead letters and its audit records."""
    role = _role(user)
    if role is None:
        return []
    own = list(SERVICE_PUBLISHES[role])
    if user == KUBE:
        teams = sorted(kube_teams) if kube_teams is not None else ["*"]
        own += [*(f"job.submitted.{t}" for t in teams), *(f"job.cancel_requested.{t}" for t in teams),
                *(f"utilization.flops_reported.{t}" for t in teams)]
    return [f"{ns}.{tail}" for tail in own] + [f"{ns}.dlq.{role}", f"{ns}.audit.recorded.{role}"]


def stream_rights(user: str | None, ns: str, stream: Stream) -> str | None:
    """What a bus user may do to a stream's configuration: "update" (admins, the stream's owner, and connections
    without a gpuq user: an unauthenticated server), "create" (a service that uses it: creating a missing stream
    with its declaration cannot change one that exists), or None (a stream it neither publishes to nor consumes)."""
    role = _role(user) if user is not None and user != ADMIN else None
    if role is None:
        return None if user is not None and user.startswith(TEAM_PREFIX) else "update"
    if stream.owner == role:
        return "update"
    used = [*_published(user or "", ns), *(f"{ns}.{p}" for p in _consumed(user or ""))]
    return "create" if any(matches(p, subject) for p in stream.subjects for subject in used) else None


def _consumed(user: str) -> tuple[str, ...]:
    role = _role(user)
    return SERVICE_CONSUMES.get(user, SERVICE_CONSUMES[role]) if role is not None else ()


def with_credentials(url: str, user: str, password: str) -> str:
    """`nats://host:4222` with user and password: the form NATS_URL takes for an authenticated server."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, parts.query, parts.fragment))


def url_user(url: str) -> str | None:
    parts = urlsplit(url)
    return unquote(parts.username) if parts.username else None


def inbox_prefix_for(url: str) -> str:
    """The reply inbox prefix to connect with (nats-py / FastStream `inbox_prefix`): a bus user's replies arrive
    on its own prefix, the only subjects it may subscribe to; `_INBOX` without a user (or for admins)."""
    user = url_user(url)
    return inbox_prefix(user) if user and user != ADMIN else "_INBOX"


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))



def matches(pattern: str, subject: str) -> bool:
    """Does NATS subject `subject` match `pattern` (with `*` and `>` wildcards)?"""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)
