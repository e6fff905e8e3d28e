"""Label and field selectors as kube-apiserver parses them (query strings) and as controllers use them
(`LabelSelector` objects with matchLabels/matchExpressions)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import bad_request

# A requirement is one clause of a selector: (key, operator, values).
Requirement = tuple[str, str, tuple[str, ...]]

_SET_CLAUSE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")
_EQ_CLAUSE = re.compile(r"^\s*([A-Za-z0-9._/-]+)\s*(==|=|!=)\s*([A-Za-z0-9._-]*)\s*$")


def _split_clauses(text: str) -> list[str]:
    """Split on commas that are not inside `in (...)` value lists."""
    clauses, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            clauses.append("".join(current))
            current = []
        else:
            current.append(char)
    clauses.append("".join(current))
    return [clause for clause in clauses if clause.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """`a=b,c!=d,e in (f,g),h notin (i),j,!k` → requirements; a clear 400 for anything else."""
    if not text:
        return []
    requirements: list[Requirement] = []
    for clause in _split_clauses(text):
        if match := _EQ_CLAUSE.match(clause):
            key, op, value = match.groups()
            requirements.append((key, "!=" if op == "!=" else "=", (value,)))
        elif match := _SET_CLAUSE.match(clause):
            negate, key, op, values = match.groups()
            if op:
                if negate:
                    raise bad_request(f"unable to parse requirement: {clause!r}: '!' cannot be combined with {op}")
                parsed = tuple(sorted(v.strip() for v in values.split(",") if v.strip()))
                requirements.append((key, op, parsed))
            else:
                requirements.append((key, "!" if negate else "exists", ()))
        else:
            raise bad_request(f"unable to parse requirement: found {clause!r} in label selector {text!r}")
    return requirements


def labels_match(requirements: list[Requirement], labels: Mapping[str, str] | None) -> bool:
    labels = labels or {}
    for key, op, values in requirements:
        present = key in labels
        value = labels.get(key)
        if op == "=" and value != values[0]:
            return False
        if op == "!=" and present and value == values[0]:
            return False
        if op == "in" and value not in values:
            return False
        if op == "notin" and present and value in values:
            return False
        if op == "exists" and not present:
            return False
        if op == "!" and present:
            return False
    return True


def label_selector_object_match(selector: Mapping[str, Any] | None, labels: Mapping[str, str] | None) -> bool:
    """A `metav1.LabelSelector` (matchLabels + matchExpressions). An empty selector matches everything,
    as for Jobs; a None selector matches nothing, as the API conventions say."""
    if selector is None:
        return False
    requirements: list[Requirement] = [(k, "=", (v,)) for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}[expression["operator"]]
        requirements.append((expression["key"], op, tuple(expression.get("values") or ())))
    return labels_match(requirements, labels)


# --- field selectors -------------------------------------------------------------------------------------------

_FIELD_CLAUSE = re.compile(r"^\s*([A-Za-z0-9._]+)\s*(==|=|!=)\s*(.*?)\s*$")


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    negate: bool
    value: str


def parse_field_selector(text: str | None, supported: frozenset[str], kind: str) -> list[FieldRequirement]:
    """Only the fields kube-apiserver supports for the kind; others are the same 400 the real server returns."""
    if not text:
        return []
    requirements = []
    for clause in _split_clauses(text):
        match = _FIELD_CLAUSE.match(clause)
        if not match:
            raise bad_request(f"invalid selector: {text!r}; can't understand {clause!r}")
        field, op, value = match.groups()
        if field not in supported:
            raise bad_request(f"field label not supported: {field}", details={"kind": kind})
        requirements.append(FieldRequirement(field, op == "!=", value))
    return requirements


def field_value(obj: Mapping[str, Any], dotted: str) -> str:
    """The string a field selector compares against: missing fields are the empty string, as in the real server."""
    node: Any = obj
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


def fields_match(requirements: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, r.field) == r.value) != r.negate for r in requirements)


def make_matcher(labels: list[Requirement], fields: list[FieldRequirement]) -> Callable[[Mapping[str, Any]], bool]:
    def matches(obj: Mapping[str, Any]) -> bool:
        return labels_match(labels, (obj.get("metadata") or {}).get("labels")) and fields_match(fields, obj)

    return matches
