"""Governance at submit: size limits every job obeys, and each team's policy from queues.yaml (`governance`).

Pure: admission calls it on every submission it receives (whatever path it came by), and the API calls the same
functions before publishing, so an HTTP caller is told at once. A breach is a `Violation` whose message names the
field and the rule.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import QueuesConfig, TeamPolicy
from shared.domain import JobSpec
from shared.quota_keys import CPU, MEMORY

SPEC_TOO_LARGE = "SpecTooLarge"
NO_GPU_REQUESTED = "NoGpuRequested"
POLICY_VIOLATION = "PolicyViolation"
AWAITING_APPROVAL = "AwaitingApproval"

# A spec travels on every event of its job (admitted, placed, requeued): it stays small. Kubernetes' own limits
# for label keys (253 with prefix) are kept; values may be longer than Kubernetes' 63 for cost attribution.
MAX_SPEC_BYTES = 64 * 1024
MAX_LABELS = 64
MAX_LABEL_KEY = 253
MAX_LABEL_VALUE = 1024

# An environment variable named like a credential must not carry its value inline.
SECRET_NAME_RE = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)",
                            re.IGNORECASE)
# Values that are credentials whatever they are called (private keys, well-known token shapes).
SECRET_VALUE_RE = re.compile(r"(-----BEGIN [A-Z ]*PRIVATE KEY-----|\bAKIA[0-9A-Z]{16}\b|\bghp_[A-Za-z0-9]{36}\b|"
                             r"\bxox[abprs]-[A-Za-z0-9-]{10,}|\bsk-[A-Za-z0-9]{20,})")


@dataclass(frozen=True)
class Violation:
    reason: str
    message: str
    rule: str = ""  # the policy setting (or check) that refused it: `allowed_images`, `allow_privileged` ...


def gpu_request_violation(spec: JobSpec, *, cpu_queue: bool = False) -> Violation | None:
    """A job that asks for no GPU at all (every pod set has gpus_per_pod 0 and no MIG profile). gpuq schedules
    GPU jobs: such a job would hold a node's CPU and memory, be placed on a GPU node and be counted as GPU work,
    unless its queue sets a CPU or memory quota (`cpu_queue`, `charges_cpu`): that queue bounds and charges it.
    A pod set with no GPU inside a job that has GPU pods (a launcher, a parameter server) is legitimate: it takes
    no GPU quota (its queue's CPU and memory quotas, where set) and is bound to no GPU."""
    if (not cpu_queue and spec.total_gpus == 0 and spec.total_mig_slices == 0
            and not any(ps.shared for ps in spec.pod_sets)):
        return Violation(NO_GPU_REQUESTED, f"job {spec.job_id} asks for no GPU (gpus_per_pod is 0 in every pod set): "
                                           "gpuq schedules GPU jobs; ask for at least 1 GPU, a part of one "
                                           "(gpu_fraction, gpu_memory_mib) or a MIG slice (mig_profile), or submit "
                                           f"to a queue with a CPU or memory quota ({CPU}, {MEMORY})",
                         "gpus_per_pod")
    return None


def charges_cpu(config: QueuesConfig | None, queue: str) -> bool:
    """Whether the queue sets a CPU or memory quota: it then takes jobs that ask for no GPU (docs/admission.md)."""
    q = config.queue_map.get(queue) if config is not None else None
    return q is not None and (CPU in q.quotas or MEMORY in q.quotas)


def size_violation(spec: JobSpec, *, cpu_queue: bool = False) -> Violation | None:
    """Labels and the whole spec within their caps (a 900 KB label must not travel on every event), and a GPU
    request at all (`gpu_request_violation`): every submission path (the CLI, the API, admission) checks this."""
    no_gpu = gpu_request_violation(spec, cpu_queue=cpu_queue)
    if no_gpu is not None:
        return no_gpu
    if len(spec.labels) > MAX_LABELS:
        return Violation(SPEC_TOO_LARGE, f"job {spec.job_id}: {len(spec.labels)} labels, at most {MAX_LABELS}")
    for key, value in sorted(spec.labels.items()):
        if len(key) > MAX_LABEL_KEY:
            return Violation(SPEC_TOO_LARGE, f"job {spec.job_id}: label key {key[:40]!r}… is {len(key)} characters, "
                                             f"at most {MAX_LABEL_KEY}")
        if len(value) > MAX_LABEL_VALUE:
            return Violation(SPEC_TOO_LARGE, f"job {spec.job_id}: label {key!r} is {len(value)} characters, at most "
                                             f"{MAX_LABEL_VALUE}")
    size = len(spec.model_dump_json().encode())
    if size > MAX_SPEC_BYTES:
        return Violation(SPEC_TOO_LARGE, f"job {spec.job_id}: the spec is {size} bytes, at most {MAX_SPEC_BYTES}")
    return None


# ----------------------------------------------------------------------------- names and paths, normalised
#
# A policy compares names, so a name must have one spelling before it is compared: `team-a/../team-b/x` is team-b's
# path, `registry.example.com.evil.io` is another host than `registry.example.com`. Names are parsed and compared
# by their parts (host, then path segments); a name with a `.` / `..` segment, an empty segment, a control
# character, a backslash or a percent-encoded separator is refused outright rather than guessed at.

# An image reference as the container runtimes read it (distribution/reference): [host[:port]/]path[:tag][@digest].
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
                      r"(?:\.(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9]))*(?::[0-9]{1,5})?$")
_IMAGE_SEGMENT_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG_RE = re.compile(r"^\w[\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")
DEFAULT_REGISTRY = "docker.io"  # where a name without a registry host is pulled from
_ODD_RE = re.compile(r"[\x00-\x20\x7f\\]|%(?:2e|2f|5c)", re.IGNORECASE)
_SCHEME_RE = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$", re.IGNORECASE | re.DOTALL)


class NameRefused(ValueError):
    """A name (image, dataset, path) in a form a policy cannot compare safely; the message says why."""


@dataclass(frozen=True)
class ImageName:
    host: str  # lower-case, without its port
    port: str | None
    path: str  # the repository path below the host, without tag or digest: `team-a/train`


def _segments_refusal(segments: list[str]) -> str | None:
    for segment in segments:
        if segment in (".", ".."):
            return f"it has a {segment!r} path segment"
        if segment == "":
            return "it has an empty path segment ('//')"
    return None


def parse_image(image: str) -> ImageName:
    """An image reference split into host, port and repository path (NameRefused: not a reference a runtime would
    pull as written). A name without a registry host (`python:3`) is Docker Hub's (`docker.io/library/python`)."""
    if _ODD_RE.search(image):
        raise NameRefused(f"image {image!r} is not a valid image reference: it has whitespace, a control character, "
                          "a backslash or a percent-encoded separator")
    rest, _, digest = image.partition("@")
    if digest and not _DIGEST_RE.match(digest):
        raise NameRefused(f"image {image!r} is not a valid image reference: digest {digest!r} is not <algorithm>:<hex>")
    head, slash, tail = rest.rpartition("/")
    name, _, tag = tail.partition(":")
    if tag and not _TAG_RE.match(tag):
        raise NameRefused(f"image {image!r} is not a valid image reference: tag {tag!r} is not a valid tag")
    segments = (head.split("/") if slash else []) + [name]
    host = DEFAULT_REGISTRY
    if len(segments) > 1 and ("." in segments[0] or ":" in segments[0] or segments[0] == "localhost"):
        host = segments.pop(0)
        if not _HOST_RE.match(host):
            raise NameRefused(f"image {image!r} is not a valid image reference: {host!r} is not a registry host")
    elif len(segments) == 1:
        segments.insert(0, "library")  # Docker Hub's official images
    why = _segments_refusal(segments)
    if why is None:
        bad = [s for s in segments if not _IMAGE_SEGMENT_RE.match(s)]
        why = f"path segment {bad[0]!r} is not lower-case letters and digits joined by '.', '_' or '-'" if bad else None
    if why is not None:
        raise NameRefused(f"image {image!r} is not a valid image reference: {why}")
    hostname, _, port = host.lower().partition(":")
    return ImageName(hostname, port or None, "/".join(segments))


def image_allowed(image: ImageName, prefix: str) -> bool:
    """Whether `image` is under an allowed prefix: `registry.example.com` (that host, on any port; never
    `registry.example.com.evil.io`), `registry.example.com:5000` (that host and port), or
    `registry.example.com/team-a` (that host, and paths `team-a` or below `team-a/`; never `team-ab`)."""
    host, _, path = prefix.strip().rstrip("/").partition("/")
    hostname, _, port = host.lower().partition(":")
    if hostname != image.host or (port and port != image.port):
        return False
    return not path or image.path == path or image.path.startswith(path + "/")


def normalise_path(value: str, what: str = "dataset") -> str:
    """A dataset, claim or host path in one spelling: the trailing '/' dropped, a URL's scheme kept
    (`s3://bucket/x`); NameRefused for `.` / `..` or empty segments and odd characters (never resolved: a name
    that needs resolving was written to get past a pattern)."""
    if not value or _ODD_RE.search(value):
        raise NameRefused(f"{what} {value!r} is refused: it is empty, or has whitespace, a control character, a "
                          "backslash or a percent-encoded separator")
    scheme = _SCHEME_RE.match(value)
    prefix, rest = (scheme.group(1).lower() + "://", scheme.group(2)) if scheme else ("", value)
    absolute = rest.startswith("/") and not prefix
    segments = rest.strip("/").split("/") if rest.strip("/") else []
    why = _segments_refusal(segments) if segments else "it names no path"
    if why is not None:
        raise NameRefused(f"{what} {value!r} is refused: {why}; name it without '.', '..' or empty segments")
    return prefix + ("/" if absolute else "") + "/".join(segments)


def name_matches(value: str, patterns: tuple[str, ...]) -> bool:
    """A normalised name against shell-style patterns (normalised too, so `team-a/*/` is `team-a/*`)."""
    return any(fnmatch.fnmatchcase(value, _pattern(p)) for p in patterns)


def _pattern(pattern: str) -> str:
    stripped = pattern.rstrip("/")
    return stripped or pattern


# ----------------------------------------------------------------------------- what a spec uses


def _templates(spec: JobSpec) -> Iterator[Any]:
    """Pod templates of an event-submitted job (present when the spec carries how to run its pods)."""
    for pod_set in spec.pod_sets:
        template = getattr(pod_set, "template", None)
        if template is not None:
            yield template


def images(spec: JobSpec) -> list[str]:
    return sorted({str(t.image) for t in _templates(spec) if getattr(t, "image", None)})


# Volume sources that bring no data from outside the pod (or only the cluster's own objects): nothing to check.
_SELF_CONTAINED_VOLUMES = frozenset({"emptyDir", "configMap", "secret", "downwardAPI", "projected"})
# Volume sources checked against a policy below; any other (iscsi, cephfs, glusterfs, rbd, csi, fc, cloud disks,
# flexVolume, ...) mounts storage directly, past the dataset allow-list.
_CHECKED_VOLUMES = frozenset({"persistentVolumeClaim", "ephemeral", "nfs", "hostPath", "image"})


@dataclass(frozen=True)
class Mount:
    """One volume of a pod template: its kind (the volume source's key) and what it names."""

    volume: str
    kind: str
    source: dict[str, Any]


def volumes(spec: JobSpec) -> Iterator[Mount]:
    """Every volume source of the job's pod templates (Kubernetes Volumes: a name and one source each)."""
    for t in _templates(spec):
        yield from volumes_of(t)


def volumes_of(template: Any) -> Iterator[Mount]:
    """The volume sources of one pod template."""
    for i, volume in enumerate(getattr(template, "volumes", ()) or ()):
        name = str(volume.get("name", f"#{i}"))
        for kind, source in sorted(volume.items()):
            if kind != "name":
                yield Mount(name, kind, source if isinstance(source, dict) else {})


def datasets(spec: JobSpec) -> list[str]:
    """Datasets the job reaches, as written: those the spec names, volumes claimed by name (PersistentVolumeClaims),
    claims an ephemeral volume is cloned from, and NFS exports (`server:path`)."""
    found = set(spec.datasets)
    for mount in volumes(spec):
        if mount.kind == "persistentVolumeClaim" and mount.source.get("claimName"):
            found.add(str(mount.source["claimName"]))
        elif mount.kind == "ephemeral":
            claim = (mount.source.get("volumeClaimTemplate") or {}).get("spec") or {}
            for key in ("dataSource", "dataSourceRef"):
                if isinstance(claim.get(key), dict) and claim[key].get("name"):
                    found.add(str(claim[key]["name"]))
        elif mount.kind == "nfs":
            found.add(f"{mount.source.get('server', '')}:{mount.source.get('path', '')}")
    return sorted(found)


def inline_secrets(spec: JobSpec) -> list[str]:
    """Where a credential is written into the spec instead of referenced: env values and label values."""
    places: list[str] = []
    for t in _templates(spec):
        for env in getattr(t, "env", ()) or ():
            name, value = str(getattr(env, "name", "")), str(getattr(env, "value", "") or "")
            if value and (SECRET_NAME_RE.search(name) or SECRET_VALUE_RE.search(value)):
                places.append(f"env {name}")
    for key, value in sorted(spec.labels.items()):
        if SECRET_VALUE_RE.search(value) or (value and SECRET_NAME_RE.search(key) and len(value) >= 16):
            places.append(f"label {key}")
    return places


# ----------------------------------------------------------------------------- the team's policy


def policy_violation(spec: JobSpec, policy: TeamPolicy) -> Violation | None:
    try:
        return _policy_violation(spec, policy)
    except NameRefused as exc:
        return Violation(POLICY_VIOLATION, f"job {spec.job_id}: {exc}", "names")


def _policy_violation(spec: JobSpec, policy: TeamPolicy) -> Violation | None:
    team = spec.team
    if policy.max_gpus_per_job is not None and spec.total_gpus > policy.max_gpus_per_job:
        return Violation(POLICY_VIOLATION, f"job {spec.job_id} asks for {spec.total_gpus} GPUs; team {team} may use "
                                           f"at most {policy.max_gpus_per_job} per job", "max_gpus_per_job")
    mounted_images = [str(m.source.get("reference", "")) for m in volumes(spec) if m.kind == "image"]
    for image in sorted({*images(spec), *mounted_images}):
        parsed = parse_image(image)  # a malformed reference is refused whatever the policy
        if policy.allowed_images is not None and not any(image_allowed(parsed, p) for p in policy.allowed_images):
            allowed = ", ".join(policy.allowed_images) or "none"
            return Violation(POLICY_VIOLATION, f"job {spec.job_id}: image {image!r} is not from a registry team "
                                               f"{team} may use (allowed: {allowed}; a host matches only itself, a "
                                               "path only at '/')", "allowed_images")
    violation = _volume_violation(spec, policy)
    if violation is not None:
        return violation
    for dataset in datasets(spec):
        name = normalise_path(dataset)
        if policy.allowed_datasets is not None and not name_matches(name, policy.allowed_datasets):
            allowed = ", ".join(policy.allowed_datasets) or "none"
            return Violation(POLICY_VIOLATION, f"job {spec.job_id}: dataset {dataset!r} is not one team {team} "
                                               f"may use (allowed: {allowed})", "allowed_datasets")
    if policy.secrets_by_reference_only:
        places = inline_secrets(spec)
        if places:
            return Violation(POLICY_VIOLATION, f"job {spec.job_id}: a credential is written inline in "
                                               f"{', '.join(places)}; pass secrets by reference (a Kubernetes "
                                               "Secret mounted or referenced), never by value",
                             "secrets_by_reference_only")
    return None


def _volume_violation(spec: JobSpec, policy: TeamPolicy) -> Violation | None:
    """Volumes that reach storage past the dataset allow-list: a node's own files (hostPath: refused unless the
    policy lists the path), an NFS export without its server and path, and any other storage mounted directly
    (iscsi, cephfs, csi ...), refused while the team's datasets are restricted unless the policy names the kind."""
    team = spec.team
    for mount in volumes(spec):
        where = f"job {spec.job_id}: volume {mount.volume!r}"
        if mount.kind == "hostPath":
            path = normalise_path(str(mount.source.get("path", "")), "hostPath")
            if not path.startswith("/") or not name_matches(path, policy.allowed_host_paths):
                allowed = ", ".join(policy.allowed_host_paths) or "none"
                return Violation(POLICY_VIOLATION, f"{where} mounts the node's path {path!r} (hostPath); team {team} "
                                                   f"may mount host paths {allowed}", "allowed_host_paths")
        elif mount.kind == "nfs" and not (mount.source.get("server") and mount.source.get("path")):
            return Violation(POLICY_VIOLATION, f"{where}: an nfs volume names its server and path", "allowed_datasets")
        elif (mount.kind not in _SELF_CONTAINED_VOLUMES and mount.kind not in _CHECKED_VOLUMES
              and policy.allowed_datasets is not None and mount.kind not in policy.allowed_volume_sources):
            return Violation(POLICY_VIOLATION, f"{where} mounts {mount.kind} storage directly, past the datasets "
                                               f"team {team} may use; mount a dataset through an allowed "
                                               "PersistentVolumeClaim or nfs export (or an admin allows "
                                               f"{mount.kind} in allowed_volume_sources)", "allowed_volume_sources")
    return None


# ----------------------------------------------------------------------------- what a pod may reach past itself
#
# Read from a Kubernetes PodSpec (a workload's pod template: the Kubernetes intake and admission webhook), so that a
# pod's settings are judged whatever path the job came by. The checks are Pod Security Standards' `baseline` ones
# that reach the node: privileged containers, host namespaces, host ports, added capabilities beyond the default set
# (host paths are the volume rules above).

# Capabilities a container runtime grants by default (baseline allows adding these back, and nothing else).
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def containers(pod_spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every container of a PodSpec: init, main and ephemeral."""
    for key in _CONTAINER_LISTS:
        for container in pod_spec.get(key) or ():
            if isinstance(container, Mapping):
                yield container


def host_access(pod_spec: Mapping[str, Any]) -> list[str]:
    """The settings of a PodSpec that reach past its containers into the node, each named where it is."""
    found = [field for field in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(field) is True]
    if ((pod_spec.get("securityContext") or {}).get("windowsOptions") or {}).get("hostProcess") is True:
        found.append("securityContext.windowsOptions.hostProcess")
    for c in containers(pod_spec):
        name, context = c.get("name", "?"), c.get("securityContext") or {}
        if context.get("privileged") is True:
            found.append(f"container {name}: privileged")
        if (context.get("windowsOptions") or {}).get("hostProcess") is True:
            found.append(f"container {name}: windowsOptions.hostProcess")
        added = sorted({str(a) for a in (context.get("capabilities") or {}).get("add") or ()}
                       - BASELINE_CAPABILITIES)
        if added:
            found.append(f"container {name}: capabilities {', '.join(added)}")
        ports = sorted({str(p.get("hostPort")) for p in c.get("ports") or () if isinstance(p, Mapping) and
                        p.get("hostPort")})
        if ports:
            found.append(f"container {name}: hostPort {', '.join(ports)}")
    return found


def host_access_violation(job_id: str, team: str, where: str, pod_spec: Mapping[str, Any], policy: TeamPolicy
                          ) -> Violation | None:
    """Privileged settings and host namespaces, refused unless the team's policy allows them."""
    found = host_access(pod_spec)
    if found and not policy.allow_privileged:
        return Violation(POLICY_VIOLATION, f"job {job_id}: {where} asks for {'; '.join(found)}, which reach the "
                                           f"node; team {team} may not use privileged settings or host namespaces "
                                           "(an admin may set allow_privileged)", "allow_privileged")
    return None


def service_account_violation(job_id: str, team: str, where: str, account: str | None, policy: TeamPolicy
                              ) -> Violation | None:
    """The ServiceAccount a pod runs as, against the team's list (null: any of the pod's own namespace)."""
    allowed = policy.allowed_service_accounts
    name = account or "default"
    if allowed is not None and not any(fnmatch.fnmatchcase(name, p) for p in allowed):
        return Violation(POLICY_VIOLATION, f"job {job_id}: {where} runs as ServiceAccount {name!r}; team {team} may "
                                           f"use {', '.join(allowed) or 'none'}", "allowed_service_accounts")
    return None


# ----------------------------------------------------------------------------- event-submitted jobs stay home
#
# The executor creates an event-submitted job's workload with its own rights, so what the job names must not reach
# past its team: its namespace must be one queues.yaml maps to the team, its pods run as a ServiceAccount the policy
# lists (only `default` unless it says otherwise), mount only the kinds of volume judged above (or that the policy
# names) and reference only the Secrets the policy lists. A workload created in the cluster is its author's, with
# its author's rights there: its namespace is where it is, and what its pods use is judged by the rules above.

# A volume source's fields that name a Secret of the pod's namespace (csi, cephfs, rbd, iscsi, flexVolume, ...).
_SECRET_REF_KEYS = ("secretRef", "nodePublishSecretRef", "nodeStageSecretRef", "controllerPublishSecretRef",
                    "controllerExpandSecretRef", "nodeExpandSecretRef")


def home_violation(spec: JobSpec, policy: TeamPolicy, namespaces: Collection[str]) -> Violation | None:
    """Where an event-submitted job runs and what it may use there: `namespaces` are those queues.yaml maps to the
    job's team (`QueuesConfig.team_namespaces`). Jobs without pod templates name no namespace but their workload's."""
    team = spec.team
    named = [(what, ns) for what, ns in (("namespace", spec.namespace),
                                          ("workload namespace", spec.workload.namespace if spec.workload else None))
             if ns is not None]
    for what, ns in named:
        if ns not in namespaces:
            mapped = ", ".join(namespaces) or "none"
            return Violation(POLICY_VIOLATION, f"job {spec.job_id}: {what} {ns!r} is not one of team {team}'s "
                                               f"(queues.yaml namespaces: {mapped})", "namespaces")
    if spec.workload is not None:
        return None
    accounts = policy if policy.allowed_service_accounts is not None else policy.model_copy(
        update={"allowed_service_accounts": ("default",)})
    secrets = policy.allowed_secrets
    for ps in spec.pod_sets:
        t = ps.template
        if t is None:
            continue
        where = f"pod set {ps.name}"
        violation = service_account_violation(spec.job_id, team, where, t.service_account_name, accounts)
        if violation is not None:
            return violation
        for mount in volumes_of(t):
            if (mount.kind not in _SELF_CONTAINED_VOLUMES and mount.kind not in _CHECKED_VOLUMES
                    and mount.kind not in policy.allowed_volume_sources):
                return Violation(POLICY_VIOLATION, f"job {spec.job_id}: {where}: volume {mount.volume!r} is a "
                                                   f"{mount.kind} volume; team {team}'s jobs may mount "
                                                   f"{', '.join(sorted(_SELF_CONTAINED_VOLUMES | _CHECKED_VOLUMES))}"
                                                   f" and the kinds its policy allows", "allowed_volume_sources")
        for place, secret in secret_references(t):
            if not any(fnmatch.fnmatchcase(secret, p) for p in secrets):
                return Violation(POLICY_VIOLATION, f"job {spec.job_id}: {where}: {place} references Secret "
                                                   f"{secret!r}; team {team} may reference "
                                                   f"{', '.join(secrets) or 'no Secret'}", "allowed_secrets")
    return None


def secret_references(template: Any) -> Iterator[tuple[str, str]]:
    """(where, Secret name) for every Secret a pod template names: secret volumes, projected volumes' secret
    sources, a volume source's secretRef, env `value_from.secretKeyRef`."""
    for mount in volumes_of(template):
        where = f"volume {mount.volume!r}"
        if mount.kind == "secret":
            yield where, str(mount.source.get("secretName", ""))
        elif mount.kind == "projected":
            for source in mount.source.get("sources") or ():
                if isinstance(source, dict) and isinstance(source.get("secret"), dict):
                    yield where, str(source["secret"].get("name", ""))
        for key in _SECRET_REF_KEYS:
            ref = mount.source.get(key)
            if isinstance(ref, dict):
                yield where, str(ref.get("name", ""))
    for env in getattr(template, "env", ()) or ():
        ref = (getattr(env, "value_from", None) or {}).get("secretKeyRef")
        if isinstance(ref, dict):
            yield f"env {env.name}", str(ref.get("name", ""))


def submission_violation(spec: JobSpec, policy: TeamPolicy, namespaces: Collection[str] = (), *,
                         cpu_queue: bool = False) -> Violation | None:
    """Everything refused at submit: size first, then the team's policy, then where the job would run
    (`namespaces`: those mapped to its team; none by default, so a job naming a namespace is refused).
    `cpu_queue`: its queue sets a CPU or memory quota (`charges_cpu`), so a job asking for no GPU is taken."""
    return (size_violation(spec, cpu_queue=cpu_queue) or policy_violation(spec, policy)
            or home_violation(spec, policy, namespaces))


def needs_approval(spec: JobSpec, policy: TeamPolicy) -> bool:
    return spec.priority_class in policy.approval_required_classes
