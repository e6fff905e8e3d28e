"""NodeInventory in parts: a 20,000-node cluster announced as events that each fit in one NATS message, parsed back to
the same nodes, and read by telemetry (the consumer for which "not announced = gone") only at the last part."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from services.core.telemetry.state import TelemetryState
from shared.domain import NodeSpec
from shared.events import INVENTORY_CHUNK, NodeInventory, encode_event, make_event, parse_event

NATS_MAX_PAYLOAD = 1024 * 1024
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _nodes(n: int, prefix: str = "node") -> list[NodeSpec]:
    return [NodeSpec(name=f"{prefix}-{i:05d}", gpus=8, gpu_model="H100-80GB", cpu_milli=192_000,
                     memory_mib=2_000_000, rack=f"rack-{i // 32:03d}", block=f"block-{i // 512:02d}",
                     labels={"topology.kubernetes.io/zone": "zone-a", "node.kubernetes.io/instance-type": "p5"})
            for i in range(n)]


def test_a_20000_node_inventory_round_trips_in_parts_that_each_fit_a_nats_message() -> None:
    nodes = _nodes(20_000)
    parts = NodeInventory.chunked(list(reversed(nodes)), source="sim", announcement="a1")
    assert len(parts) == 20_000 // INVENTORY_CHUNK
    back: list[NodeSpec] = []
    for i, part in enumerate(parts, start=1):
        body = encode_event(make_event(part, source="test", time=T0))
        assert len(body) < NATS_MAX_PAYLOAD // 2, len(body)
        _, parsed = parse_event(body)
        assert isinstance(parsed, NodeInventory)
        assert (parsed.part, parsed.parts, parsed.announcement) == (i, len(parts), "a1")
        back.extend(parsed.nodes)
    assert back == nodes  # every node once, in name order


def test_a_small_inventory_is_one_plain_part() -> None:
    [only] = NodeInventory.chunked(_nodes(3), source="sim", announcement="a1")
    assert (only.part, only.parts, only.announcement, len(only.nodes)) == (1, 1, "", 3)
    [empty] = NodeInventory.chunked([], source="sim", announcement="a1")
    assert empty.nodes == () and empty.last_part


def test_parts_are_validated() -> None:
    with pytest.raises(ValidationError, match="cannot exceed the number of parts"):
        NodeInventory(nodes=(), part=3, parts=2, announcement="a")
    with pytest.raises(ValidationError, match="names no announcement"):
        NodeInventory(nodes=(), part=1, parts=2)


def test_telemetry_removes_unannounced_nodes_only_after_the_last_part() -> None:
    state = TelemetryState()
    state.apply(NodeInventory(nodes=tuple(_nodes(3, "old"))), 0.0)
    kept = _nodes(1200)
    parts = NodeInventory.chunked(kept, source="sim", announcement="a2")
    for part in parts[:-1]:
        state.apply(part, 1.0)
        # the nodes of earlier parts stay, and so do the old ones until the announcement is complete
        assert {f"old-{i:05d}" for i in range(3)} <= set(state.nodes)
    state.apply(parts[-1], 1.0)
    assert sorted(state.nodes) == [n.name for n in kept]
