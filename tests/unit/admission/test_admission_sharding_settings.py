"""Which cohorts an admission instance serves, and what follows: leases, consumer names, owned queues."""

from __future__ import annotations

import re

import pytest

from services.admission.sharding import NO_COHORT, Shard, cohort_of, parse_cohorts
from services.stack import StackSettings
from shared.config import parse_queues

CONFIG = parse_queues({
    "priority_classes": [{"name": "normal", "value": 100}],
    "cohorts": [{"name": "alpha"}, {"name": "beta"}],
    "queues": [{"name": "a1", "cohort": "alpha"}, {"name": "b1", "cohort": "beta"}, {"name": "solo"}],
}, "test")
DURABLE_SAFE = re.compile(r"^[A-Za-z0-9_+-]+$")


def test_the_setting_is_a_sorted_set_and_empty_means_all() -> None:
    assert parse_cohorts(" beta, alpha,,alpha ") == ("alpha", "beta")
    assert parse_cohorts("") == () and parse_cohorts(None) == ()
    assert Shard.of(()).serves_all and Shard.of(None).serves_all and Shard.of([" "]).serves_all
    assert Shard.of(["beta", "alpha"]) == Shard.of(["alpha", "beta", "alpha"]) == Shard.of("alpha,beta")


def test_the_environment_variable_is_the_stack_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUQ_ADMISSION_COHORTS", "beta,-")
    assert StackSettings(nats_url="n", database_url="d", queues=CONFIG).admission_cohorts == ("-", "beta")
    monkeypatch.delenv("GPUQ_ADMISSION_COHORTS")
    assert StackSettings(nats_url="n", database_url="d", queues=CONFIG).admission_cohorts == ()


def test_all_cohorts_keeps_the_single_instance_names_and_owns_everything() -> None:
    shard = Shard.of(None)
    assert (shard.consumer_suffix, shard.lease_scopes, shard.shared_lease_scopes) == ("", (), ())
    assert shard.queues(CONFIG) == ["a1", "b1", "solo"]
    assert shard.owns_queue(CONFIG, "nope") and shard.owns_unknown_queues


def test_a_cohort_set_owns_its_queues_and_leads_per_cohort() -> None:
    shard = Shard.of(["beta", NO_COHORT])
    assert shard.queues(CONFIG) == ["b1", "solo"]
    assert shard.owns_queue(CONFIG, "solo") and not shard.owns_queue(CONFIG, "a1")
    assert shard.owns_queue(CONFIG, "deleted-or-unknown") and shard.owns_unknown_queues
    assert not Shard.of(["alpha"]).owns_unknown_queues and not Shard.of(["alpha"]).owns_queue(CONFIG, "nope")
    assert shard.lease_scopes == ("admission/-", "admission/beta")  # sorted: no two instances wait in a cycle
    assert shard.shared_lease_scopes == ("admission",)
    assert shard.consumer_suffix == "-c--+beta"
    assert cohort_of(CONFIG, "solo") == NO_COHORT and cohort_of(CONFIG, "b1") == "beta"


def test_consumer_names_stay_valid_for_any_cohort_names() -> None:
    odd = Shard.of(["team.x", "y z"])
    long = Shard.of([f"cohort-{i:03d}" for i in range(20)])
    for shard in (odd, long):
        assert DURABLE_SAFE.match(shard.consumer_suffix) and len(shard.consumer_suffix) <= 20
    assert odd.consumer_suffix != Shard.of(["team.x"]).consumer_suffix


def test_a_cohort_tree_is_served_by_the_instance_of_its_root() -> None:
    tree = parse_queues({
        "priority_classes": [{"name": "normal", "value": 100}],
        "cohorts": [{"name": "org"}, {"name": "vision", "parent": "org"}, {"name": "cv", "parent": "vision"}],
        "queues": [{"name": "q-org", "cohort": "org"}, {"name": "q-cv", "cohort": "cv"}],
    }, "test")
    assert cohort_of(tree, "q-cv") == "org"  # quota flows across the tree: one instance decides for all of it
    assert Shard.of(["org"]).queues(tree) == ["q-cv", "q-org"]
    assert Shard.of(["cv"]).queues(tree) == []
