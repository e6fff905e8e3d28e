"""Dynamic admission, as kube-apiserver does it: on a client's create or update, the registered
MutatingWebhookConfigurations are called over HTTPS (in name order, each webhook in its order, every JSON Patch
applied to the object the next one sees), then every matching ValidatingWebhookConfiguration; any denial refuses
the request. Only webhooks whose rules, namespaceSelector, objectSelector and CEL `matchConditions` match are
called; a call that fails (unreachable, TLS error, timeout, a malformed reply) refuses the request under
`failurePolicy: Fail` (the default) and is skipped under `Ignore`.

`matchConditions` (cel.py, a real CEL implementation): every condition must be true for the webhook to be called;
any false one skips it (even where another failed to evaluate); otherwise an evaluation error refuses the request
(403, without calling the webhook) under `Fail` and skips the webhook under `Ignore`.

Not emulated (docs/kubernetes.md, "What it does not emulate"): CEL's type checking and cost limits and the
`authorizer` variable (cel.py), `reinvocationPolicy`, webhooks on the fake's own actors' writes (its controllers
create pods through the store, not through the API), warnings (the reply's `warnings` are not sent back as Warning
headers), `admissionReviewVersions` other than v1, and `sideEffects`/dry-run negotiation."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonpatch
from kmock import KubernetesError

from . import cel
from .auth import UserInfo
from .resources import NAMESPACES, ResourceType
from .selectors import label_selector_object_match
from .store import Obj, Store

ADMISSION = "admissionregistration.k8s.io"


@dataclass
class Call:
    """One webhook call, for tests to look at (`fake.admission.calls`)."""

    configuration: str
    webhook: str
    operation: str
    resource: str
    namespace: str | None
    name: str | None
    # allowed, denied, patched, failed: <why>, ignored: <why>; not called (matchConditions): skipped: <condition>,
    # refused: <evaluation error> (Fail), ignored: <evaluation error> (Ignore)
    outcome: str


def _denied(name: str, status: Mapping[str, Any]) -> KubernetesError:
    code = int(status.get("code") or 403)
    message = status.get("message") or ""
    return KubernetesError(status=code, reason=str(status.get("reason") or "Forbidden"),
                           message=f'admission webhook "{name}" denied the request: {message}'.rstrip(": "))


def _failed(name: str, url: str, why: str) -> KubernetesError:
    return KubernetesError(status=500, reason="InternalError",
                           message=f'Internal error occurred: failed calling webhook "{name}": failed to call '
                                   f'webhook: Post "{url}": {why}')


def _matches_rule(rule: Mapping[str, Any], operation: str, resource: ResourceType, subresource: str | None) -> bool:
    def any_of(values: Any, value: str) -> bool:
        values = values or ()
        return "*" in values or value in values

    if not any_of(rule.get("operations"), operation):
        return False
    if not any_of(rule.get("apiGroups"), resource.group) or not any_of(rule.get("apiVersions"), resource.version):
        return False
    wanted = f"{resource.plural}/{subresource}" if subresource else resource.plural
    names = rule.get("resources") or ()
    resource_ok = (wanted in names or "*/*" in names or (subresource is None and "*" in names)
                   or (subresource is not None and f"*/{subresource}" in names))
    if not resource_ok:
        return False
    scope = rule.get("scope") or "*"
    return scope == "*" or (scope == "Namespaced") == resource.namespaced


def _request(uid: str, operation: str, resource: ResourceType, subresource: str | None, namespace: str | None,
             obj: Obj, user: UserInfo | None, dry_run: bool) -> dict[str, Any]:
    """An AdmissionReview v1 request, without the objects (what a matchCondition sees as `request`)."""
    who = user.as_status() if user is not None else {"username": "system:anonymous", "groups": []}
    kind = {"group": resource.group, "version": resource.version, "kind": resource.kind}
    gvr = {"group": resource.group, "version": resource.version, "resource": resource.plural}
    return {"uid": uid, "kind": kind, "resource": gvr, **({"subResource": subresource} if subresource else {}),
            "requestKind": kind, "requestResource": gvr, "name": (obj.get("metadata") or {}).get("name") or "",
            **({"namespace": namespace} if namespace else {}), "operation": operation, "userInfo": who,
            "dryRun": dry_run, "options": {}}


@dataclass
class AdmissionChain:
    store: Store
    # Where a `service` clientConfig goes: (namespace, name) -> "host:port" (a real cluster's Service DNS).
    services: dict[tuple[str, str], str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def configurations(self, kind: str) -> list[Obj]:
        from .resources import MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS

        res = MUTATING_WEBHOOK_CONFIGURATIONS if kind == "mutating" else VALIDATING_WEBHOOK_CONFIGURATIONS
        return sorted(self.store.list(res), key=lambda c: c["metadata"]["name"])

    def active(self) -> bool:
        return bool(self.configurations("mutating") or self.configurations("validating"))

    async def admit(self, operation: str, resource: ResourceType, subresource: str | None, namespace: str | None,
                    obj: Obj, old: Obj | None, user: UserInfo | None, dry_run: bool) -> Obj:
        """The object after the mutating webhooks; raises the refusal of any webhook (or of a failed call)."""
        for config in self.configurations("mutating"):
            for hook in config.get("webhooks") or ():
                if self._selected(hook, operation, resource, subresource, namespace, obj, old) and \
                        self._conditions_hold(config, hook, operation, resource, subresource, namespace, obj, old,
                                              user, dry_run):
                    obj = await self._call(config, hook, operation, resource, subresource, namespace, obj, old,
                                           user, dry_run, mutating=True)
        validating = [(c, h) for c in self.configurations("validating") for h in c.get("webhooks") or ()
                      if self._selected(h, operation, resource, subresource, namespace, obj, old)
                      and self._conditions_hold(c, h, operation, resource, subresource, namespace, obj, old, user,
                                                dry_run)]
        await asyncio.gather(*(self._call(c, h, operation, resource, subresource, namespace, obj, old, user,
                                          dry_run, mutating=False) for c, h in validating))
        return obj

    def _conditions_hold(self, config: Obj, hook: Mapping[str, Any], operation: str, resource: ResourceType,
                         subresource: str | None, namespace: str | None, obj: Obj, old: Obj | None,
                         user: UserInfo | None, dry_run: bool) -> bool:
        """Whether the webhook's matchConditions send it this request (matchconditions.Matcher): all true: yes; any
        false: no; otherwise an evaluation error refuses the request under Fail and skips the webhook under Ignore."""
        conditions = hook.get("matchConditions") or ()
        if not conditions:
            return True
        request = _request("", operation, resource, subresource, namespace, obj, user, dry_run)
        errors = []
        for condition in conditions:
            expression = str(condition.get("expression") or "")
            try:
                if not cel.evaluate(expression, obj, old, request):
                    self._record(config, hook, operation, resource, namespace, obj,
                                 f"skipped: {condition.get('name')} is false")
                    return False
            except cel.EvaluationError as exc:
                errors.append(f"expression '{expression}' resulted in error: {exc}")
        if not errors:
            return True
        if (hook.get("failurePolicy") or "Fail") == "Ignore":
            self._record(config, hook, operation, resource, namespace, obj, f"ignored: {errors[0]}")
            return False
        self._record(config, hook, operation, resource, namespace, obj, f"refused: {errors[0]}")
        what = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        name = (obj.get("metadata") or {}).get("name") or ""
        reason = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise KubernetesError(status=403, reason="Forbidden", message=f'{what} "{name}" is forbidden: {reason}')

    def _record(self, config: Obj, hook: Mapping[str, Any], operation: str, resource: ResourceType,
                namespace: str | None, obj: Obj, outcome: str) -> Call:
        record = Call(config["metadata"]["name"], str(hook.get("name")), operation, str(resource), namespace,
                      (obj.get("metadata") or {}).get("name"), outcome)
        self.calls.append(record)
        return record

    def _selected(self, hook: Mapping[str, Any], operation: str, resource: ResourceType, subresource: str | None,
                  namespace: str | None, obj: Obj, old: Obj | None) -> bool:
        if not any(_matches_rule(r, operation, resource, subresource) for r in hook.get("rules") or ()):
            return False
        if resource is NAMESPACES:
            ns_labels = (obj.get("metadata") or {}).get("labels") or {}
        elif resource.namespaced:
            ns_obj = self.store.find(NAMESPACES, None, namespace or "")
            ns_labels = ((ns_obj or {}).get("metadata") or {}).get("labels") or {}
        else:
            ns_labels = None  # a cluster-scoped object: the namespaceSelector does not apply
        if ns_labels is not None and not label_selector_object_match(hook.get("namespaceSelector") or {}, ns_labels):
            return False
        selector = hook.get("objectSelector") or {}
        candidates = [o for o in (obj, old) if o is not None]
        return any(label_selector_object_match(selector, (o.get("metadata") or {}).get("labels") or {})
                   for o in candidates)

    def _endpoint(self, client: Mapping[str, Any]) -> str:
        if client.get("url"):
            return str(client["url"])
        service = client.get("service") or {}
        where = self.services.get((str(service.get("namespace")), str(service.get("name"))))
        host = where or f"{service.get('name')}.{service.get('namespace')}.svc:{service.get('port') or 443}"
        return f"https://{host}{service.get('path') or ''}"

    async def _call(self, config: Obj, hook: Mapping[str, Any], operation: str, resource: ResourceType,
                    subresource: str | None, namespace: str | None, obj: Obj, old: Obj | None,
                    user: UserInfo | None, dry_run: bool, *, mutating: bool) -> Obj:
        name = str(hook.get("name"))
        client = hook.get("clientConfig") or {}
        url = self._endpoint(client)
        record = self._record(config, hook, operation, resource, namespace, obj, "")
        uid = str(uuid.uuid4())
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {**_request(uid, operation, resource, subresource, namespace, obj, user, dry_run),
                              "object": obj, "oldObject": old}}
        try:
            reply = await self._post(url, client, review, float(hook.get("timeoutSeconds") or 10))
            answer = reply.get("response") or {}
            if reply.get("apiVersion") != "admission.k8s.io/v1" or reply.get("kind") != "AdmissionReview" \
                    or answer.get("uid") != uid:
                raise ValueError(f"expected response.uid={uid!r}, got {answer.get('uid')!r}")
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError, ValueError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if (hook.get("failurePolicy") or "Fail") == "Ignore":
                record.outcome = f"ignored: {why}"
                return obj
            record.outcome = f"failed: {why}"
            raise _failed(name, url, why) from exc
        if not answer.get("allowed"):
            record.outcome = "denied"
            raise _denied(name, answer.get("status") or {})
        if answer.get("patch"):
            if not mutating or answer.get("patchType") != "JSONPatch":
                record.outcome = "failed: a patch from a validating webhook or not JSONPatch"
                raise _failed(name, url, "the webhook returned a patch it may not")
            ops = json.loads(base64.b64decode(answer["patch"]))
            try:
                obj = jsonpatch.apply_patch(obj, ops)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                record.outcome = f"failed: {exc}"
                raise _failed(name, url, f"the patch does not apply: {exc}") from exc
            record.outcome = "patched"
            return obj
        record.outcome = "allowed"
        return obj

    @staticmethod
    async def _post(url: str, client: Mapping[str, Any], review: Obj, timeout_s: float) -> Obj:
        if not url.startswith("https://"):
            raise ValueError(f"webhook URL {url!r} must use https")
        context = ssl.create_default_context()
        if client.get("caBundle"):
            context = ssl.create_default_context(cadata=base64.b64decode(client["caBundle"]).decode())
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(url, json=review, ssl=context) as response:
            if response.status != 200:
                raise ValueError(f"the webhook answered HTTP {response.status}")
            body = await response.json(content_type=None)
            if not isinstance(body, dict):
                raise ValueError("the webhook's answer is not a JSON object")
            return body
