"""Who is calling and what they may do: the parts of kube-apiserver's authentication and RBAC authorization that
gpuq relies on.

- Authentication: the fake's own bearer token (an unrestricted cluster admin, `kubefake-admin` in group
  system:masters); ServiceAccount tokens from the TokenRequest API (`POST .../serviceaccounts/<name>/token`, what
  `kubectl create token` calls), valid for their audiences until they expire or their ServiceAccount is deleted;
  and user tokens a test registers, standing for what an OIDC or webhook authenticator gives (a name and groups).
  The API server itself accepts only tokens made for its own audience.
- TokenReview (`POST /apis/authentication.k8s.io/v1/tokenreviews`): who a token belongs to, for the audiences asked.
- RBAC: Roles, ClusterRoles, RoleBindings and ClusterRoleBindings in the store decide each request of a
  ServiceAccount or user token (verbs, API groups, resources and subresources, resourceNames, `*`), with the real
  Forbidden message. The admin token is not checked (system:masters).

Each request is logged with the caller's name and its RBAC attributes (`AccessLog`), so a test can compare what a
component really did with what its role grants."""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

from kmock import KubernetesError

from .clock import format_time
from .errors import invalid, not_found
from .resources import (
    CLUSTER_ROLE_BINDINGS,
    CLUSTER_ROLES,
    ROLE_BINDINGS,
    ROLES,
    SERVICE_ACCOUNTS,
    ResourceType,
)
from .store import Obj, Store

API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # kube-apiserver's --api-audiences default
ADMIN_USER = "kubefake-admin"
DEFAULT_EXPIRATION_S = 3600
MIN_EXPIRATION_S = 600  # TokenRequest refuses shorter


@dataclass(frozen=True)
class UserInfo:
    username: str
    uid: str
    groups: tuple[str, ...]
    extra: dict[str, list[str]] = field(default_factory=dict)

    def as_status(self) -> Obj:
        out: Obj = {"username": self.username, "uid": self.uid, "groups": list(self.groups)}
        if self.extra:
            out["extra"] = self.extra
        return out


@dataclass(frozen=True)
class Credential:
    user: UserInfo
    audiences: tuple[str, ...]
    expires_at: dt.datetime | None = None
    service_account: tuple[str, str, str] | None = None  # namespace, name, uid: valid while that object lives


@dataclass(frozen=True)
class Access:
    """One request as RBAC sees it, and whether it was allowed."""

    user: str
    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None
    allowed: bool


@dataclass(frozen=True)
class Refused:
    reason: str


class Authenticator:
    def __init__(self, store: Store, admin_token: str | None) -> None:
        self.store = store
        self.admin_token = admin_token
        self._credentials: dict[str, Credential] = {}
        self.log: list[Access] = []

    # --- issuing -------------------------------------------------------------------------------------------------

    def add_user_token(self, username: str, groups: tuple[str, ...] = (),
                       audiences: tuple[str, ...] = (API_AUDIENCE,)) -> str:
        """A token for a user as an OIDC or webhook authenticator would know them (tests only)."""
        token = f"kubefake-user.{secrets.token_urlsafe(24)}"
        user = UserInfo(username, str(uuid.uuid4()), (*groups, "system:authenticated"))
        self._credentials[token] = Credential(user, audiences)
        return token

    def request_token(self, namespace: str, name: str, body: Obj) -> Obj:
        """TokenRequest: a token bound to the ServiceAccount (and its uid), for the asked audiences."""
        account = self.store.find(SERVICE_ACCOUNTS, namespace, name)
        if account is None:
            raise not_found(SERVICE_ACCOUNTS.plural, name)
        spec = dict(body.get("spec") or {})
        seconds = int(spec.get("expirationSeconds") or DEFAULT_EXPIRATION_S)
        if seconds < MIN_EXPIRATION_S:
            raise invalid("TokenRequest", name, f"spec.expirationSeconds: Invalid value: {seconds}: may not specify "
                                                 "a duration less than 10 minutes")
        audiences = tuple(spec.get("audiences") or (API_AUDIENCE,))
        uid = account["metadata"]["uid"]
        user = UserInfo(f"system:serviceaccount:{namespace}:{name}", uid,
                        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
                        {"authentication.kubernetes.io/credential-id": [f"JTI={uuid.uuid4()}"]})
        expires = self.store.clock.now() + dt.timedelta(seconds=seconds)
        token = f"kubefake-sa.{secrets.token_urlsafe(32)}"
        self._credentials[token] = Credential(user, audiences, expires, (namespace, name, uid))
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
                "spec": {"audiences": list(audiences), "expirationSeconds": seconds, "boundObjectRef": None},
                "status": {"token": token, "expirationTimestamp": format_time(expires)}}

    # --- checking ------------------------------------------------------------------------------------------------

    def authenticate(self, token: str, audiences: tuple[str, ...] = (API_AUDIENCE,)
                     ) -> tuple[UserInfo, tuple[str, ...]] | Refused:
        """The token's user and the asked audiences it is valid for, or why it is not accepted."""
        if self.admin_token is not None and secrets.compare_digest(token, self.admin_token):
            if API_AUDIENCE not in audiences:
                return Refused(f"token audiences [\"{API_AUDIENCE}\"] is invalid for the target audiences "
                               f"{_quoted(audiences)}")
            return UserInfo(ADMIN_USER, "kubefake-admin", ("system:masters", "system:authenticated")), (API_AUDIENCE,)
        credential = self._credentials.get(token)
        if credential is None:
            return Refused("invalid bearer token")
        if credential.expires_at is not None and self.store.clock.now() >= credential.expires_at:
            return Refused("service account token has expired")
        if credential.service_account is not None:
            namespace, name, uid = credential.service_account
            account = self.store.find(SERVICE_ACCOUNTS, namespace, name)
            if account is None or account["metadata"]["uid"] != uid:
                return Refused(f"service account {namespace}/{name} has been deleted")
        valid = tuple(a for a in audiences if a in credential.audiences)
        if not valid:
            return Refused(f"token audiences {_quoted(credential.audiences)} is invalid for the target audiences "
                           f"{_quoted(audiences)}")
        return credential.user, valid

    def review(self, body: Obj) -> Obj:
        """TokenReview: the answer is a status, never an error, whatever the token."""
        spec = dict(body.get("spec") or {})
        token = spec.get("token")
        if not token:
            raise invalid("TokenReview", "", "spec.token: Required value")
        asked = tuple(spec.get("audiences") or (API_AUDIENCE,))
        found = self.authenticate(str(token), asked)
        if isinstance(found, Refused):
            status: Obj = {"authenticated": False, "user": {}, "error": f"[invalid bearer token, {found.reason}]"}
        else:
            user, valid = found
            status = {"authenticated": True, "user": user.as_status(), "audiences": list(valid)}
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}

    def is_admin(self, user: UserInfo) -> bool:
        return "system:masters" in user.groups

    # --- RBAC ----------------------------------------------------------------------------------------------------

    def authorize(self, user: UserInfo, verb: str, resource: ResourceType, subresource: str | None,
                  namespace: str | None, name: str | None) -> None:
        """Raise Forbidden unless a binding of the user's gives a rule covering the request."""
        target = f"{resource.plural}/{subresource}" if subresource else resource.plural
        allowed = self.is_admin(user) or any(
            _covers(rule, verb, resource.group, target, name)
            for rule in self._rules_for(user, namespace if resource.namespaced else None))
        self.log.append(Access(user.username, verb, resource.group, target, namespace, name, allowed))
        if not allowed:
            raise forbidden(user.username, verb, resource, target, namespace if resource.namespaced else None, name)

    def used_by(self, username: str) -> dict[tuple[str, str], set[str]]:
        """(API group, resource) -> the verbs `username` was allowed, from the log."""
        used: dict[tuple[str, str], set[str]] = {}
        for access in self.log:
            if access.user == username and access.allowed:
                used.setdefault((access.group, access.resource), set()).add(access.verb)
        return used

    def _rules_for(self, user: UserInfo, namespace: str | None) -> list[Obj]:
        rules: list[Obj] = []
        for binding in self.store.list(CLUSTER_ROLE_BINDINGS):
            if _binds(binding, user):
                rules += self._role_rules(binding["roleRef"], None)
        if namespace is not None:
            for binding in self.store.list(ROLE_BINDINGS, namespace):
                if _binds(binding, user):
                    rules += self._role_rules(binding["roleRef"], namespace)
        return rules

    def _role_rules(self, ref: Obj, namespace: str | None) -> list[Obj]:
        if ref.get("kind") == "ClusterRole":
            role = self.store.find(CLUSTER_ROLES, None, ref.get("name", ""))
        elif namespace is not None:
            role = self.store.find(ROLES, namespace, ref.get("name", ""))
        else:
            role = None
        return list((role or {}).get("rules") or [])


def _binds(binding: Obj, user: UserInfo) -> bool:
    binding_ns = (binding.get("metadata") or {}).get("namespace")
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == user.username:
            return True
        if kind == "Group" and name in user.groups:
            return True
        if kind == "ServiceAccount":
            namespace = subject.get("namespace") or binding_ns
            if user.username == f"system:serviceaccount:{namespace}:{name}":
                return True
    return False


def _covers(rule: Obj, verb: str, group: str, resource: str, name: str | None) -> bool:
    if rule.get("nonResourceURLs"):
        return False
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    if "*" not in verbs and verb not in verbs:
        return False
    if "*" not in groups and group not in groups:
        return False
    plural, _, sub = resource.partition("/")
    if not any(r in ("*", resource) or (sub and r == f"*/{sub}") or (not sub and r == plural) for r in resources):
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def _quoted(values: tuple[str, ...]) -> str:
    return "[" + " ".join(f'"{v}"' for v in values) + "]"


def forbidden(username: str, verb: str, resource: ResourceType, target: str, namespace: str | None,
              name: str | None) -> KubernetesError:
    subject = f'{target}.{resource.group}' if resource.group else target
    what = f'{subject} "{name}"' if name else subject
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    return KubernetesError(
        status=403, reason="Forbidden",
        message=f'{what} is forbidden: User "{username}" cannot {verb} resource "{target}" in API group '
                f'"{resource.group}" {where}',
        details={k: v for k, v in {"name": name, "group": resource.group, "kind": resource.plural}.items() if v})


def request_verb(method: str, params: Any, name: str | None) -> str:
    """The RBAC verb of an HTTP request, as kube-apiserver derives it."""
    if method == "GET":
        if str(params.get("watch", "")) in ("true", "True", "1"):
            return "watch"
        return "get" if name else "list"
    if method == "DELETE":
        return "delete" if name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())

