"""Who a Kubernetes identity is to gpuq's API (services/api/kubeauth.py), and its settings from the environment."""

from __future__ import annotations

import pytest

from services.api.kubeauth import KubeUser, NoTeam, TokenReviewSettings, principal_for
from services.api.tokens import Principal
from shared.config import NamespaceMapping

MAPPING = (NamespaceMapping(name="ml-a", team="team-a", queues=("team-a",)),)
SETTINGS = TokenReviewSettings(enabled=True, admin_groups=("ops",))


def sa(namespace: str, name: str = "pipeline") -> KubeUser:
    return KubeUser(f"system:serviceaccount:{namespace}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"))


def test_a_service_account_acts_for_its_namespaces_team_and_is_audited_as_itself() -> None:
    who = principal_for(sa("ml-a"), MAPPING, SETTINGS)
    assert who == Principal("system:serviceaccount:ml-a:pipeline", "team-a", admin=False, via="kube")
    assert isinstance(who, Principal) and who.actor == "kube:system:serviceaccount:ml-a:pipeline"
    assert isinstance(principal_for(sa("ml-b"), MAPPING, SETTINGS), NoTeam)


def test_admin_groups_win_and_users_need_exactly_one_team_group() -> None:
    admin = principal_for(KubeUser("system:serviceaccount:ml-a:ops", ("ops",)), MAPPING, SETTINGS)
    assert isinstance(admin, Principal) and admin.admin and admin.team is None
    assert admin.actor == "admin:kube:system:serviceaccount:ml-a:ops"
    assert principal_for(KubeUser("bob", ("gpuq:team:team-b", "dev")), MAPPING, SETTINGS) == Principal(
        "bob", "team-b", admin=False, via="kube")
    assert isinstance(principal_for(KubeUser("eve", ("gpuq:team:a", "gpuq:team:b")), MAPPING, SETTINGS), NoTeam)
    assert isinstance(principal_for(KubeUser("carol", ("gpuq:team:",)), MAPPING, SETTINGS), NoTeam)
    # No admin groups configured: a group that happens to be named like one grants nothing.
    assert isinstance(principal_for(KubeUser("x", ("ops",)), MAPPING, TokenReviewSettings(enabled=True)), NoTeam)


def test_settings_from_the_environment() -> None:
    assert TokenReviewSettings.from_env({}) == TokenReviewSettings()
    got = TokenReviewSettings.from_env({"GPUQ_API_TOKEN_REVIEW": "true", "GPUQ_API_TOKEN_AUDIENCES": "gpuq, b,,",
                                        "GPUQ_API_ADMIN_GROUPS": "ops", "GPUQ_API_TEAM_GROUP_PREFIX": "team-"})
    assert got == TokenReviewSettings(enabled=True, audiences=("b", "gpuq"), admin_groups=("ops",),
                                      team_group_prefix="team-")
    with pytest.raises(ValueError, match="use true or false"):
        TokenReviewSettings.from_env({"GPUQ_API_TOKEN_REVIEW": "maybe"})
