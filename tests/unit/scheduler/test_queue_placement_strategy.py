"""A queue's own placement strategy (queues.yaml `placement_strategy`): its jobs are placed spread (or binpacked)
while every other queue keeps the scheduler's strategy; the config is validated; the simulator honours it."""

from __future__ import annotations

import pytest

from services.core.scheduler import ClusterState, Placement, Unplaceable, schedule_cycle
from services.core.scheduler.types import PendingJob
from shared.config import ConfigError, parse_queues, placement_strategies
from tests.unit.scheduler.scheduler_builders import job, nodes


def _node_of(result: Placement | Unplaceable) -> str:
    assert isinstance(result, Placement), result
    return result.bindings[0].node


def _of(queue: str, job_id: str, gpus: int = 1):  # type: ignore[no-untyped-def]
    return job(job_id, gpus=gpus).model_copy(update={"queue": queue, "team": queue})


def _half_full() -> ClusterState:
    state = ClusterState.from_nodes(nodes(3), queue_strategies={"wide": "spread"})
    busy = state.place(_of("team-a", "busy", gpus=4))
    assert isinstance(busy, Placement)
    state.commit(busy)  # n-0 has 4 free, n-1 and n-2 have 8
    return state


def test_a_spread_queue_goes_to_the_emptiest_node_and_the_others_binpack() -> None:
    state = _half_full()
    assert _node_of(state.place(_of("team-a", "packed"))) == "n-0"  # binpack: the fullest node that fits
    assert _node_of(state.place(_of("wide", "spread"))) in {"n-1", "n-2"}  # spread: an empty node
    assert state.strategy == "binpack"  # the index's own strategy is unchanged after a spread search
    # a copy (what-if, ETA replay) keeps the queues' strategies
    assert _node_of(state.copy().place(_of("wide", "spread"))) in {"n-1", "n-2"}


def test_the_cycle_places_each_queue_with_its_strategy_and_memos_do_not_mix_them() -> None:
    state = _half_full()
    pending = [PendingJob(spec=_of("team-a", "p1")), PendingJob(spec=_of("wide", "s1"))]
    result = schedule_cycle(state, pending, [], now=0.0)
    where = {p.job_id: p.bindings[0].node for p in result.placed}
    assert where["p1"] == "n-0" and where["s1"] in {"n-1", "n-2"}


def test_a_queue_that_names_the_default_is_no_exception_and_bad_names_are_refused() -> None:
    state = ClusterState.from_nodes(nodes(2), queue_strategies={"a": "binpack", "b": "spread"})
    assert dict(state.queue_strategies) == {"b": "spread"}
    assert state.strategy_for("a") == state.strategy_for("zzz") == "binpack" and state.strategy_for("b") == "spread"
    with pytest.raises(ValueError, match="placement strategy must be one of"):
        ClusterState.from_nodes(nodes(1), queue_strategies={"a": "scatter"})


PCS = [{"name": "normal", "value": 100}]


def test_queues_yaml_sets_it_per_queue_and_names_a_bad_value() -> None:
    config = parse_queues({"priority_classes": PCS, "queues": [
        {"name": "wide", "placement_strategy": "spread"}, {"name": "packed", "placement_strategy": "binpack"},
        {"name": "default"}]})
    assert placement_strategies(config) == {"wide": "spread", "packed": "binpack"}
    assert "placement_strategy" not in config.queues[2].model_dump(mode="json")  # unset stays out of the dump
    with pytest.raises(ConfigError, match=r"queues\[0\]\.placement_strategy"):
        parse_queues({"priority_classes": PCS, "queues": [{"name": "a", "placement_strategy": "scatter"}]})
