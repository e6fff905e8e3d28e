"""The four PATCH content types kube-apiserver accepts.

- JSON merge patch (RFC 7386): exact.
- JSON patch (RFC 6902): exact, through the `jsonpatch` library.
- Strategic merge patch: the common cases. Lists are merged by the patch merge key of the field *name* (containers
  by name, tolerations replaced, schedulingGates by name, conditions by type, ...), which is what the Kubernetes
  Go types declare for the fields clients patch in practice; `$patch: delete|replace|merge` list-element and map
  directives and `$deleteFromPrimitiveList/<field>` work; `$setElementOrder` and `$retainKeys` are accepted and
  ignored. Custom resources refuse it with 415, as the real server does.
- Server-side apply: approximated as a strategic merge of the applied configuration without field ownership,
  so no apply conflicts and fields left out of a later apply are not removed.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from .errors import KubernetesError, bad_request, invalid, unsupported_media_type

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH_YAML = "application/apply-patch+yaml"
APPLY_PATCH_CBOR = "application/apply-patch+cbor"

# patchMergeKey of list fields in the core/batch Go types, by field name. Lists not named here are atomic
# (replaced whole), as `tolerations`, `args` and `command` are in the real types.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "schedulingGates": "name",
    "conditions": "type",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "taints": "key",
    "addresses": "type",
}
# Lists of scalars whose patch strategy is `merge` (set union) rather than replace.
MERGED_SCALAR_LISTS = frozenset({"finalizers"})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        if directive == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        if directive == "delete":
            return None
        result = copy.deepcopy(target) if isinstance(target, dict) else {}
        for key, value in patch.items():
            if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
                continue
            if key.startswith("$deleteFromPrimitiveList/"):
                name = key.split("/", 1)[1]
                result[name] = [item for item in result.get(name) or [] if item not in (value or [])]
                continue
            if value is None:
                result.pop(key, None)
                continue
            merged = strategic_merge_patch(result.get(key), value, key)
            if merged is None and isinstance(value, dict) and value.get("$patch") == "delete":
                result.pop(key, None)
            else:
                result[key] = merged
        return result
    if isinstance(patch, list):
        return _merge_list(target if isinstance(target, list) else [], patch, field)
    return copy.deepcopy(patch)


def _merge_list(target: list[Any], patch: list[Any], field: str) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    if field in MERGED_SCALAR_LISTS:
        return list(target) + [item for item in patch if item not in target]
    key = MERGE_KEYS.get(field)
    if key is None or not all(isinstance(item, dict) for item in patch):
        return [copy.deepcopy(item) for item in patch]
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if key not in item:
            raise bad_request(f"map: {item} does not contain declared merge key: {key}")
        position = next(
            (i for i, old in enumerate(result) if isinstance(old, dict) and old.get(key) == item[key]), None
        )
        if item.get("$patch") == "delete":
            if position is not None:
                del result[position]
        elif position is None:
            result.append(strategic_merge_patch({}, item, field))
        else:
            result[position] = strategic_merge_patch(result[position], item, field)
    return result


def json_patch(target: dict[str, Any], operations: Any, kind: str, name: str) -> dict[str, Any]:
    if not isinstance(operations, list):
        raise bad_request("json patch must be a list of operations")
    try:
        patched: dict[str, Any] = jsonpatch.apply_patch(target, operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
        raise invalid(kind, name, f"json patch failed: {error}") from error
    return patched


def apply_patch(
    target: dict[str, Any], patch: Any, content_type: str, kind: str, name: str, custom: bool
) -> dict[str, Any]:
    """Apply one PATCH body of `content_type` to `target`; raises the real server's 4xx for what cannot be done."""
    if content_type == MERGE_PATCH:
        return merge_patch(target, patch)
    if content_type == JSON_PATCH:
        return json_patch(target, patch, kind, name)
    if content_type == STRATEGIC_MERGE_PATCH:
        if custom:
            raise unsupported_media_type(
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH_YAML}, {APPLY_PATCH_CBOR}"
            )
        return strategic_merge_patch(target, patch)
    if content_type in (APPLY_PATCH_YAML, APPLY_PATCH_CBOR):
        return strategic_merge_patch(target, patch)
    raise unsupported_media_type(f"the body of the request was in an unknown format - {content_type!r}")


def parse_patch_body(body: bytes, content_type: str) -> Any:
    import json

    import yaml

    try:
        if content_type == APPLY_PATCH_YAML:
            return yaml.safe_load(body)
        return json.loads(body)
    except (ValueError, yaml.YAMLError) as error:
        raise bad_request(f"error decoding patch: {error}") from error


__all__ = ["KubernetesError", "apply_patch", "merge_patch", "parse_patch_body", "strategic_merge_patch"]
