"""API errors as kube-apiserver reports them: an HTTP status plus a `Status` body with a machine-readable reason.

They are kmock's `KubernetesError`, which kmock renders as a `Status` object; the reasons are the real
`metav1.StatusReason` values so that clients classify them as they would against a real cluster."""

from __future__ import annotations

from typing import Any

from kmock import KubernetesError


def _details(name: str | None, kind: str | None, group: str | None = None, **extra: Any) -> dict[str, Any]:
    details: dict[str, Any] = {k: v for k, v in {"name": name, "kind": kind, "group": group}.items() if v}
    details.update(extra)
    return details


def not_found(plural: str, name: str, group: str = "") -> KubernetesError:
    resource = f"{plural}.{group}" if group else plural
    return KubernetesError(
        status=404, reason="NotFound", message=f'{resource} "{name}" not found', details=_details(name, plural, group)
    )


def already_exists(plural: str, name: str, group: str = "") -> KubernetesError:
    resource = f"{plural}.{group}" if group else plural
    return KubernetesError(
        status=409,
        reason="AlreadyExists",
        message=f'{resource} "{name}" already exists',
        details=_details(name, plural, group),
    )


def conflict(plural: str, name: str, message: str, group: str = "") -> KubernetesError:
    resource = f"{plural}.{group}" if group else plural
    return KubernetesError(
        status=409,
        reason="Conflict",
        message=f'Operation cannot be fulfilled on {resource} "{name}": {message}',
        details=_details(name, plural, group),
    )


def invalid(kind: str, name: str, message: str, group: str = "") -> KubernetesError:
    return KubernetesError(
        status=422,
        reason="Invalid",
        message=f'{kind} "{name}" is invalid: {message}',
        details=_details(name, kind, group, causes=[{"reason": "FieldValueInvalid", "message": message}]),
    )


def bad_request(message: str, details: dict[str, Any] | None = None) -> KubernetesError:
    return KubernetesError(status=400, reason="BadRequest", message=message, details=details or {})


def gone(message: str) -> KubernetesError:
    return KubernetesError(status=410, reason="Expired", message=message, details={})


def method_not_allowed(message: str) -> KubernetesError:
    return KubernetesError(status=405, reason="MethodNotAllowed", message=message, details={})


def unsupported_media_type(message: str) -> KubernetesError:
    return KubernetesError(status=415, reason="UnsupportedMediaType", message=message, details={})


def unauthorized() -> KubernetesError:
    return KubernetesError(status=401, reason="Unauthorized", message="Unauthorized", details={})


def status_body(error: KubernetesError) -> dict[str, Any]:
    """The `Status` object of an error, for the places kmock does not render it (watch ERROR events)."""
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "code": error.status,
        "reason": error.reason,
        "message": error.message,
        "details": error.details or {},
    }
