"""Kubernetes tokens as API credentials: in a cluster, a pipeline presents its ServiceAccount's token (or a person
the token their cluster login gives) instead of a gpuq API token, and the API asks the API server who it belongs to
(TokenReview). Off unless `GPUQ_API_TOKEN_REVIEW=true`; gpuq's own tokens (`gpuq_<id>.<secret>`) keep working.

Who is who (`principal_for`, pure):
- a member of one of `GPUQ_API_ADMIN_GROUPS` is a platform admin;
- a ServiceAccount (`system:serviceaccount:<namespace>:<name>`) acts for the team queues.yaml `namespaces` maps its
  namespace to, as a workload created in that namespace does (docs/kubernetes.md);
- a user acts for the team named by its one group `<GPUQ_API_TEAM_GROUP_PREFIX><team>` (default `gpuq:team:`);
- anyone else is authenticated but refused (403, saying why), and a token the API server does not accept is 401.

`GPUQ_API_TOKEN_AUDIENCES` (comma separated) makes the API accept only tokens made for it (`kubectl create token SA
--audience gpuq`), so that a token a pod holds for the API server itself cannot be replayed here. A positive answer
is kept for 30 s (as kube-apiserver's own webhook authenticator caches): a deleted ServiceAccount's token can be
used that much longer. The API's service account needs `create` on `tokenreviews` and nothing else (the chart's
`gpuq-api` ClusterRole)."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview

from services.api.tokens import Principal
from shared.config import NamespaceMapping
from shared.settings import settings

log = logging.getLogger("gpuq.api.kubeauth")

ENABLED_ENV = "GPUQ_API_TOKEN_REVIEW"
AUDIENCES_ENV = "GPUQ_API_TOKEN_AUDIENCES"
ADMIN_GROUPS_ENV = "GPUQ_API_ADMIN_GROUPS"
TEAM_PREFIX_ENV = "GPUQ_API_TEAM_GROUP_PREFIX"
DEFAULT_TEAM_PREFIX = "gpuq:team:"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
CACHE_S = 30.0


@dataclass(frozen=True)
class TokenReviewSettings:
    enabled: bool = False
    audiences: tuple[str, ...] = ()  # empty: the API server's own audience
    admin_groups: tuple[str, ...] = ()
    team_group_prefix: str = DEFAULT_TEAM_PREFIX
    cache_s: float = CACHE_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> TokenReviewSettings:
        given = settings(env)
        return cls(enabled=given.api_token_review, audiences=given.api_token_audiences,
                   admin_groups=given.api_admin_groups, team_group_prefix=given.api_team_group_prefix)


@dataclass(frozen=True)
class KubeUser:
    """What the API server says a token belongs to."""

    username: str
    groups: tuple[str, ...]


@dataclass(frozen=True)
class NoTeam:
    """Authenticated, but gpuq cannot tell for which team: the reason, for the 403."""

    reason: str


def principal_for(user: KubeUser, namespaces: Sequence[NamespaceMapping],
                  settings: TokenReviewSettings) -> Principal | NoTeam:
    """Who a reviewed Kubernetes identity is to gpuq (the rules in the module's docstring)."""
    if settings.admin_groups and set(user.groups) & set(settings.admin_groups):
        return Principal(name=user.username, team=None, admin=True, via="kube")
    if user.username.startswith(SERVICE_ACCOUNT_PREFIX):
        namespace = user.username.removeprefix(SERVICE_ACCOUNT_PREFIX).split(":", 1)[0]
        team = next((m.team for m in namespaces if m.name == namespace), None)
        if team is None:
            return NoTeam(f"{user.username} is authenticated, but its namespace {namespace!r} is not mapped to a "
                          "team in queues.yaml `namespaces`")
        return Principal(name=user.username, team=team, admin=False, via="kube")
    prefix = settings.team_group_prefix
    teams = sorted({g.removeprefix(prefix) for g in user.groups if prefix and g.startswith(prefix)} - {""})
    if len(teams) == 1:
        return Principal(name=user.username, team=teams[0], admin=False, via="kube")
    if not teams:
        return NoTeam(f"{user.username} is authenticated, but in no group {prefix}<team> that names its gpuq team")
    return NoTeam(f"{user.username} is in the groups of several teams ({', '.join(teams)}): use a gpuq token "
                  "(`gpuq tokens create`) for the team to act for")


class ReviewUnavailable(RuntimeError):
    """The API server could not be asked (down, or the API's service account may not create TokenReviews)."""


class TokenReviewer:
    """Asks the API server about tokens (lightkube), remembering positive answers for `settings.cache_s`."""

    def __init__(self, settings: TokenReviewSettings, kubeconfig: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.kubeconfig = kubeconfig
        self.clock = clock
        self._client: Any = None
        self._cache: dict[bytes, tuple[float, KubeUser]] = {}

    def _api(self) -> Any:
        if self._client is None:
            config = (KubeConfig.from_file(self.kubeconfig) if self.kubeconfig is not None
                      else KubeConfig.from_service_account())  # in a pod: its own service account
            self._client = AsyncClient(config=config)
        return self._client

    async def review(self, token: str) -> KubeUser | None:
        """The token's user, or None when the API server does not accept it (for our audiences)."""
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        request = TokenReview(spec=TokenReviewSpec(token=token, audiences=list(self.settings.audiences) or None))
        try:
            answer = await self._api().create(request)
        except ApiError as exc:
            raise ReviewUnavailable(f"the Kubernetes API refused the TokenReview: {exc.status.message}") from None
        except Exception as exc:  # httpx's connection errors, timeouts
            raise ReviewUnavailable(f"cannot reach the Kubernetes API to review the token: {exc}") from None
        status = answer.status
        if status is None or not status.authenticated or status.user is None or not status.user.username:
            return None
        user = KubeUser(username=status.user.username, groups=tuple(status.user.groups or ()))
        if len(self._cache) > 10_000:  # forget expired entries now and then (tokens are many, answers brief)
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (now + self.settings.cache_s, user)
        return user

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
