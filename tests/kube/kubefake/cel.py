"""CEL for the fake's admission webhooks' `matchConditions`, evaluated by cel-python (a real CEL implementation) as
kube-apiserver evaluates them with cel-go: the variables `object` (null on DELETE), `oldObject` (null on CREATE) and
`request` (the AdmissionRequest the webhook would get, without the objects). The configuration's expressions are
compiled when it is written (a parse error refuses the configuration, 422, as the API server's validation does).

cel-python does not type-check, and compares only values of one type: `object != null` on a map is an evaluation
error here where cel-go answers true. Expressions meant for both compare `request.operation` instead (gpuq's do).
There is no `authorizer` variable: an expression that uses it fails to evaluate (then failurePolicy decides)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import celpy

from .errors import invalid

# A qualified name, as the API server requires of a match condition's name (an optional DNS prefix and "/").
_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                   r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_CONDITIONS = 64

_ENV = celpy.Environment()


class EvaluationError(Exception):
    """An expression that did not evaluate to a bool (an error, or another type)."""


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression))


def validate_configuration(kind: str, config: Mapping[str, Any]) -> None:
    """Refuse (422 Invalid) a webhook configuration whose matchConditions the API server would refuse: a name that
    is missing, repeated or not a qualified name, an empty expression, one that does not parse, more than 64."""
    name = (config.get("metadata") or {}).get("name") or ""
    problems = []
    for i, hook in enumerate(config.get("webhooks") or ()):
        conditions = hook.get("matchConditions") or ()
        where = f"webhooks[{i}].matchConditions"
        if len(conditions) > MAX_CONDITIONS:
            problems.append(f"{where}: Too many: {len(conditions)}: must have at most {MAX_CONDITIONS} items")
        seen: set[str] = set()
        for j, condition in enumerate(conditions):
            cname, expression = str(condition.get("name") or ""), str(condition.get("expression") or "")
            if not cname:
                problems.append(f"{where}[{j}].name: Required value")
            elif not _NAME.match(cname):
                problems.append(f"{where}[{j}].name: Invalid value: {cname!r}: must be a qualified name")
            elif cname in seen:
                problems.append(f"{where}[{j}].name: Duplicate value: {cname!r}")
            seen.add(cname)
            if not expression.strip():
                problems.append(f"{where}[{j}].expression: Required value")
                continue
            try:
                _program(expression)
            except celpy.CELParseError as exc:
                problems.append(f"{where}[{j}].expression: Invalid value: {expression!r}: compilation failed: {exc}")
    if problems:
        raise invalid(kind, name, "; ".join(problems), "admissionregistration.k8s.io")


def evaluate(expression: str, obj: Mapping[str, Any] | None, old: Mapping[str, Any] | None,
             request: Mapping[str, Any]) -> bool:
    """The expression's value; EvaluationError when it has none, or not a bool."""
    activation = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old),
                  "request": celpy.json_to_cel(dict(request))}
    try:
        value = _program(expression).evaluate(activation)
    except celpy.CELEvalError as exc:
        raise EvaluationError(_reason(exc)) from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # cel-python's own slips, as evaluation errors
        raise EvaluationError(f"{type(exc).__name__}: {exc}") from exc
    if isinstance(value, celpy.CELEvalError):
        raise EvaluationError(_reason(value))
    if not isinstance(value, celpy.celtypes.BoolType):
        raise EvaluationError(f"expected a bool, got {type(value).__name__}")
    return bool(value)


def _reason(error: celpy.CELEvalError) -> str:
    return str(error.args[0]) if error.args else type(error).__name__
