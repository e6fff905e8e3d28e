"""Governance at submit: size limits every job obeys, and each team's policy from queues.yaml (`governance`).

Pure: admission calls it on every submission it receives (whatever path it came by), and the API calls the same
functions before publishing, so an HTTP caller is told at once. A breach is a `Violation` whose message names the
field and the rule.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shared.config import TeamPolicy
from shared.domain import JobSpec

SPEC_TOO_LARGE = "SpecTooLarge"
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


def size_violation(spec: JobSpec) -> Violation | None:
    """Labels and the whole spec within their caps (a 900 KB label must not travel on every event)."""
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


# ----------------------------------------------------------------------------- what a spec uses


def _templates(spec: JobSpec) -> Iterator[Any]:
    """Pod templates of an event-submitted job (present when the spec carries how to run its pods)."""
    for pod_set in spec.pod_sets:
        template = getattr(pod_set, "template", None)
        if template is not None:
            yield template


def images(spec: JobSpec) -> list[str]:
    return sorted({str(t.image) for t in _templates(spec) if getattr(t, "image", None)})


def datasets(spec: JobSpec) -> list[str]:
    """Datasets named by the spec and volumes claimed by name (PersistentVolumeClaims)."""
    found = set(spec.datasets)
    for t in _templates(spec):
        for volume in getattr(t, "volumes", ()) or ():
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName") if isinstance(volume, dict) else None
            if claim:
                found.add(str(claim))
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
    team = spec.team
    if policy.max_gpus_per_job is not None and spec.total_gpus > policy.max_gpus_per_job:
        return Violation(POLICY_VIOLATION, f"job {spec.job_id} asks for {spec.total_gpus} GPUs; team {team} may use "
                                           f"at most {policy.max_gpus_per_job} per job")
    if policy.allowed_images is not None:
        for image in images(spec):
            if not any(image.startswith(prefix) for prefix in policy.allowed_images):
                allowed = ", ".join(policy.allowed_images) or "none"
                return Violation(POLICY_VIOLATION, f"job {spec.job_id}: image {image!r} is not from a registry team "
                                                   f"{team} may use (allowed prefixes: {allowed})")
    if policy.allowed_datasets is not None:
        for dataset in datasets(spec):
            if not any(fnmatch.fnmatchcase(dataset, pattern) for pattern in policy.allowed_datasets):
                allowed = ", ".join(policy.allowed_datasets) or "none"
                return Violation(POLICY_VIOLATION, f"job {spec.job_id}: dataset {dataset!r} is not one team {team} "
                                                   f"may use (allowed: {allowed})")
    if policy.secrets_by_reference_only:
        places = inline_secrets(spec)
        if places:
            return Violation(POLICY_VIOLATION, f"job {spec.job_id}: a credential is written inline in "
                                               f"{', '.join(places)}; pass secrets by reference (a Kubernetes "
                                               "Secret mounted or referenced), never by value")
    return None


def submission_violation(spec: JobSpec, policy: TeamPolicy) -> Violation | None:
    """Everything refused at submit: size first, then the team's policy."""
    return size_violation(spec) or policy_violation(spec, policy)


def needs_approval(spec: JobSpec, policy: TeamPolicy) -> bool:
    return spec.priority_class in policy.approval_required_classes
