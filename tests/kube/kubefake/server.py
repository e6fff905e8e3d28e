"""The fake kube-apiserver's HTTP side, on kmock.

kmock serves HTTP, discovery (`/api`, `/apis`, `/apis/<group>/<version>`, `/version`) and renders `Status` errors;
our reaction serves the resource paths from the stateful `Store`."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import yaml
from kmock import KubernetesError, KubernetesScaffold, ResourceInfo, Response, Server, resource

# kmock's request type and path parser: the handler builds a request itself where kmock's parser fails.
from kmock._internal import parsing, rendering

from .admission import AdmissionChain
from .auth import Authenticator, Refused, UserInfo, request_verb
from .errors import bad_request, method_not_allowed, status_body, unauthorized
from .patch import APPLY_PATCH_CBOR, APPLY_PATCH_YAML, parse_patch_body
from .resources import ALL_RESOURCES, BY_PATH, PODS, SERVICE_ACCOUNTS, ResourceType
from .selectors import make_matcher, parse_field_selector, parse_label_selector
from .store import Obj, Store, WatchStream

JSON = {"Content-Type": "application/json"}
TRUE = ("true", "True", "1")
DISCONNECT_CHECK_S = 0.5  # how often an idle watch looks whether its client went away


@dataclass(frozen=True)
class ApiPath:
    resource: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_api_path(path: str) -> ApiPath | None:
    """`/api/v1[/namespaces/<ns>]/<plural>[/<name>[/<subresource>]]` and the `/apis/<group>/<version>/...` form;
    None for discovery and other non-resource paths. An unknown resource is the real server's 404."""
    parts = [part for part in path.strip("/").split("/") if part]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    found = BY_PATH.get((group, version, rest[0]))
    if found is None or len(rest) > 3:
        raise KubernetesError(
            status=404, reason="NotFound", message="the server could not find the requested resource", details={}
        )
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    if subresource is not None and subresource not in found.subresources:
        raise KubernetesError(
            status=404, reason="NotFound", message="the server could not find the requested resource", details={}
        )
    if namespace is not None and not found.namespaced:
        raise KubernetesError(
            status=404, reason="NotFound", message="the server could not find the requested resource", details={}
        )
    return ApiPath(found, namespace, name, subresource)


def _status_success(code: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success", "code": code}


def _reply(payload: Any, status: int = 200) -> Response:
    # Always set the status and headers explicitly: kmock keeps them on the (shared) reaction between requests.
    return Response(status=status, headers=JSON, payload=payload)


def _int_param(params: Any, name: str) -> int | None:
    value = params.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as error:
        raise bad_request(f"{name} must be an integer, not {value!r}") from error


@attrs.define(kw_only=True)
class FakeKubeAPI(KubernetesScaffold):
    """kmock's Kubernetes scaffold plus a stateful store behind every resource path."""

    store: Store = attrs.field(factory=Store)
    # When set, requests must carry a bearer token: this one (an unrestricted admin), or a ServiceAccount's or a
    # user's that `auth` knows, whose requests RBAC decides (auth.py).
    token: str | None = None
    auth: Authenticator = attrs.field(init=False)
    admission: AdmissionChain = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.auth = Authenticator(self.store, self.token)
        self.admission = AdmissionChain(self.store)
        for res in ALL_RESOURCES:
            self.resources[resource(res.group, res.version, res.plural)] = ResourceInfo(
                kind=res.kind,
                namespaced=res.namespaced,
                singular=res.singular,
                shortnames=set(res.short_names),
                subresources=set(res.subresources),
                verbs={"create"} if res.create_only else {
                    "create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
            )
        self.fallback[self._is_resource_request] << self._serve

    # kmock 0.8's request parser cannot parse the `namespaces` collection path (/api/v1/namespaces): it raises.
    # Route such a request with a request object built here; everything else goes through kmock unchanged.
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        try:
            parsing.parse_path(raw_request.path)
        except ValueError:
            return await self._serve_unparsed(raw_request)
        return await super().__call__(raw_request)

    async def _serve_unparsed(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw_request.read()
        request = rendering.Request(
            id=len(self._requests),
            method=raw_request.method,
            url=raw_request.url,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode("utf-8", errors="replace"),
            raw_request=raw_request,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except rendering.StreamingError as wrapped:
            raw_response: aiohttp.web.StreamResponse = wrapped.args[0]
            await self._stream_error(wrapped.__cause__ or wrapped, raw_response)
            await raw_response.write_eof()
            return raw_response
        except Exception as error:
            return await self._render_error(error)

    @staticmethod
    def _is_resource_request(request: rendering.Request) -> bool:
        try:
            return parse_api_path(request.url.path) is not None
        except KubernetesError:
            return True  # served, as the 404 it is

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        # Exactly `application/json`, as the real server sends it: lightkube only parses a Status body then.
        response = await super()._render_error(exc)
        response.headers["Content-Type"] = "application/json"
        return response

    async def close_watches(self) -> None:
        self.store.close_all_watches()
        await asyncio.sleep(0)

    # --- dispatch ------------------------------------------------------------------------------------------------

    def _caller(self, request: rendering.Request) -> UserInfo | None:
        """The authenticated caller (401 otherwise); None when the server runs without authentication."""
        if self.token is None:
            return None
        header = request.headers.get("Authorization") or ""
        found = self.auth.authenticate(header.removeprefix("Bearer ")) if header.startswith("Bearer ") else None
        if found is None or isinstance(found, Refused):
            raise unauthorized()
        return found[0]

    async def _serve(self, request: rendering.Request) -> Response:
        path = parse_api_path(request.url.path)
        assert path is not None  # the criterion only lets resource paths through
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        params = request.params
        user = self._caller(request)
        if user is not None:
            verb = request_verb(method, params, path.name)
            self.auth.authorize(user, verb, path.resource, path.subresource, path.namespace, path.name)
        if path.resource.create_only:
            if method != "POST" or path.name is not None:
                raise method_not_allowed("the server does not allow this method on the requested resource")
            return _reply(self.auth.review(self._body(request)), 201)
        if method == "GET":
            if params.get("watch") in TRUE:
                return self._watch(request, path)
            if path.name is None:
                return _reply(self._list(path, params))
            if path.subresource not in (None, "status"):
                raise method_not_allowed(f"GET is not supported on {path.resource}/{path.subresource}")
            return _reply(self.store.get(path.resource, path.namespace, path.name))
        if method == "POST" and path.name is None and self.admission.active():
            return await self._admitted_create(request, path, user)
        if method in ("PUT", "PATCH") and path.name is not None and self.admission.active():
            return await self._admitted_update(request, path, method, user)
        if method == "POST":
            return self._post(request, path)
        if path.name is None:
            if method == "DELETE":
                return _reply(self._delete_collection(path, request))
            raise method_not_allowed(f"{method} needs an object name")
        if method == "PUT":
            return _reply(
                self.store.replace(path.resource, path.namespace, path.name, self._body(request), path.subresource)
            )
        if method == "PATCH":
            return self._patch(request, path)
        if method == "DELETE":
            options = self._delete_options(request)
            return _reply(self.store.delete(path.resource, path.namespace, path.name, **options))
        raise method_not_allowed(f"{method} is not supported")

    def _body(self, request: rendering.Request) -> Obj:
        try:
            body = json.loads(request.body or b"null")
        except ValueError as error:
            raise bad_request(f"the request body is not valid JSON: {error}") from error
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def _post(self, request: rendering.Request, path: ApiPath) -> Response:
        if path.name is None:
            if path.resource.namespaced and path.namespace is None:
                raise method_not_allowed(f"create {path.resource} needs a namespace in the path")
            dry_run = bool(request.params.get("dryRun"))
            created = self.store.create(path.resource, path.namespace, self._body(request), dry_run=dry_run)
            return _reply(created, 201)
        if path.resource is PODS and path.subresource == "binding":
            binding = self._body(request)
            target = (binding.get("target") or {}).get("name")
            if not target:
                raise bad_request("a Binding needs target.name (the node)")
            self.store.bind(path.namespace or "", path.name, target)
            return _reply(_status_success(201), 201)
        if path.resource is SERVICE_ACCOUNTS and path.subresource == "token":
            return _reply(self.auth.request_token(path.namespace or "", path.name, self._body(request)), 201)
        if path.resource is PODS and path.subresource == "eviction":
            eviction = self._body(request)
            grace = (eviction.get("deleteOptions") or {}).get("gracePeriodSeconds")
            self.store.delete(PODS, path.namespace, path.name, grace_period_s=grace)
            return _reply(_status_success(201), 201)
        raise method_not_allowed(f"POST is not supported on {path.resource}/{path.subresource or path.name}")

    # --- dynamic admission (admission.py): only while webhook configurations exist --------------------------------

    async def _admitted_create(self, request: rendering.Request, path: ApiPath, user: UserInfo | None) -> Response:
        if path.resource.namespaced and path.namespace is None:
            raise method_not_allowed(f"create {path.resource} needs a namespace in the path")
        dry_run = bool(request.params.get("dryRun"))
        candidate = self.store.create(path.resource, path.namespace, self._body(request), dry_run=True)
        namespace = candidate["metadata"].get("namespace")
        final = await self.admission.admit("CREATE", path.resource, None, namespace, candidate, None, user, dry_run)
        return _reply(self.store.create(path.resource, path.namespace, final, dry_run=dry_run), 201)

    async def _admitted_update(
        self, request: rendering.Request, path: ApiPath, method: str, user: UserInfo | None
    ) -> Response:
        """As kube-apiserver's update: the would-be object through admission, then stored if the object did not
        change meanwhile (else again from the new state, unless the client gave a resourceVersion)."""
        assert path.name is not None
        dry_run = bool(request.params.get("dryRun"))
        body = self._body(request) if method == "PUT" else None
        wanted_rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
        for _ in range(5):
            current = self.store.find(path.resource, path.namespace, path.name)
            if method == "PUT":
                assert body is not None
                candidate = self.store.replace(
                    path.resource, path.namespace, path.name, body, path.subresource, dry_run=True
                )
            else:
                candidate = self._patched(request, path, dry_run=True)
            operation = "UPDATE" if current is not None else "CREATE"
            final = await self.admission.admit(
                operation, path.resource, path.subresource, path.namespace, candidate, current, user, dry_run
            )
            if dry_run:
                return _reply(final)
            if current is None:
                return _reply(self.store.create(path.resource, path.namespace, final), 201)
            final.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
            try:
                return _reply(self.store.replace(path.resource, path.namespace, path.name, final, path.subresource))
            except KubernetesError as error:
                if error.status != 409 or wanted_rv:
                    raise
        raise KubernetesError(status=409, reason="Conflict", message="the object kept changing during admission")

    def _patched(self, request: rendering.Request, path: ApiPath, *, dry_run: bool) -> Obj:
        assert path.name is not None
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        is_apply = content_type in (APPLY_PATCH_YAML, APPLY_PATCH_CBOR)
        if is_apply and not request.params.get("fieldManager"):
            raise bad_request("PATCH requests with apply content type require fieldManager")
        body = parse_patch_body(request.body, content_type)
        return self.store.patch(path.resource, path.namespace, path.name, content_type, body, path.subresource,
                                create_missing=is_apply, dry_run=dry_run)

    def _patch(self, request: rendering.Request, path: ApiPath) -> Response:
        assert path.name is not None
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        is_apply = content_type in (APPLY_PATCH_YAML, APPLY_PATCH_CBOR)
        if is_apply and not request.params.get("fieldManager"):
            raise bad_request("PATCH requests with apply content type require fieldManager")
        body = parse_patch_body(request.body, content_type)
        patched = self.store.patch(
            path.resource, path.namespace, path.name, content_type, body, path.subresource, create_missing=is_apply
        )
        return _reply(patched)

    def _delete_options(self, request: rendering.Request) -> dict[str, Any]:
        options = json.loads(request.body) if request.body.strip() else {}
        preconditions = options.get("preconditions") or {}
        grace = _int_param(request.params, "gracePeriodSeconds")
        return {
            "grace_period_s": grace if grace is not None else options.get("gracePeriodSeconds"),
            "propagation": request.params.get("propagationPolicy") or options.get("propagationPolicy"),
            "precondition_uid": preconditions.get("uid"),
            "precondition_rv": preconditions.get("resourceVersion"),
        }

    def _matcher(self, path: ApiPath, params: Any) -> Any:
        labels = parse_label_selector(params.get("labelSelector"))
        fields = parse_field_selector(params.get("fieldSelector"), path.resource.selectable_fields, path.resource.kind)
        return make_matcher(labels, fields)

    def _list(self, path: ApiPath, params: Any) -> Obj:
        items = self.store.list(path.resource, path.namespace, self._matcher(path, params))
        rv = self.store.resource_version
        limit = _int_param(params, "limit")
        start = 0
        if params.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(params["continue"]))
                rv, start = int(token["rv"]), int(token["start"])
            except (ValueError, KeyError, TypeError) as error:
                raise bad_request("the continue token is invalid") from error
        metadata: Obj = {"resourceVersion": str(rv)}
        if limit:
            if start + limit < len(items):
                token = json.dumps({"rv": rv, "start": start + limit}).encode()
                metadata["continue"] = base64.urlsafe_b64encode(token).decode()
                metadata["remainingItemCount"] = len(items) - start - limit
            items = items[start : start + limit]
        else:
            items = items[start:]
        return {
            "apiVersion": path.resource.api_version,
            "kind": f"{path.resource.kind}List",
            "metadata": metadata,
            "items": items,
        }

    def _delete_collection(self, path: ApiPath, request: rendering.Request) -> Obj:
        matcher = self._matcher(path, request.params)
        options = self._delete_options(request)
        deleted = []
        for obj in self.store.list(path.resource, path.namespace, matcher):
            meta = obj["metadata"]
            deleted.append(self.store.delete(path.resource, meta.get("namespace"), meta["name"], **options))
        return {
            "apiVersion": path.resource.api_version,
            "kind": f"{path.resource.kind}List",
            "metadata": {},
            "items": deleted,
        }

    # --- watch ---------------------------------------------------------------------------------------------------

    def _watch(self, request: rendering.Request, path: ApiPath) -> Response:
        params = request.params
        matcher = self._matcher(path, params)
        if path.name is not None:  # GET .../pods/<name>?watch=true: the same as a metadata.name field selector
            by_name = make_matcher(
                [], parse_field_selector(f"metadata.name={path.name}", path.resource.selectable_fields, "")
            )
            inner = matcher
            matcher = lambda obj: inner(obj) and by_name(obj)  # noqa: E731
        since = _int_param(params, "resourceVersion")
        try:
            stream = self.store.watch(
                path.resource,
                path.namespace,
                matcher,
                since,
                bookmarks=params.get("allowWatchBookmarks") in TRUE,
                send_initial_events=params.get("sendInitialEvents") in TRUE,
            )
        except KubernetesError as error:
            # A too-old resourceVersion: the real server answers 200 and one ERROR event with a 410 Status.
            return Response(status=200, headers=JSON, payload=_one_error(status_body(error)))
        timeout = _int_param(params, "timeoutSeconds")
        return Response(status=200, headers=JSON, payload=self._stream(stream, request, timeout))

    async def _stream(
        self, stream: WatchStream, request: rendering.Request, timeout_s: int | None
    ) -> AsyncIterator[Any]:
        yield b""  # send the headers now: a watch with nothing to say is still an open watch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else None
        raw = request._raw_request
        try:
            while True:
                wait = DISCONNECT_CHECK_S
                if deadline is not None:
                    wait = min(wait, deadline - loop.time())
                    if wait <= 0:
                        break
                try:
                    event = await asyncio.wait_for(stream.queue.get(), wait)
                except TimeoutError:
                    if raw is not None and (raw.transport is None or raw.transport.is_closing()):
                        break
                    continue
                if event is None:
                    break
                yield event
        finally:
            self.store.stop_watch(stream)


async def _one_error(status: Obj) -> AsyncIterator[Any]:
    yield {"type": "ERROR", "object": status}


# --- running it ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeAccess:
    """How a client reaches an API server: the kubeconfig file and what it says."""

    kubeconfig: Path
    server: str
    token: str | None
    namespace: str = "default"


def write_kubeconfig(path: Path, server: str, token: str | None, namespace: str = "default") -> KubeAccess:
    user: Obj = {"token": token} if token else {}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubefake", "cluster": {"server": server}}],
        "users": [{"name": "kubefake", "user": user}],
        "contexts": [
            {"name": "kubefake", "context": {"cluster": "kubefake", "user": "kubefake", "namespace": namespace}}
        ],
        "current-context": "kubefake",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return KubeAccess(path, server, token, namespace)


class FakeKubeServer:
    """The fake API server listening on a free local port: `async with FakeKubeServer(dir) as server`."""

    def __init__(self, directory: Path, store: Store | None = None, token: str | None = "kubefake-token") -> None:
        self.api = FakeKubeAPI(store=store or Store(), token=token)
        self._directory = directory
        self._server: Server | None = None
        self.access: KubeAccess | None = None

    @property
    def store(self) -> Store:
        return self.api.store

    async def __aenter__(self) -> FakeKubeServer:
        await self.api.__aenter__()
        self._server = Server(self.api)
        await self._server.__aenter__()
        url = str(self._server.url).rstrip("/")
        self.access = write_kubeconfig(self._directory / "kubeconfig", url, self.api.token)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.api.close_watches()
        if self._server is not None:
            await self._server.__aexit__(None, None, None)
        await self.api.__aexit__(None, None, None)
