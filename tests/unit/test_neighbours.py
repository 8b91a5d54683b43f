"""Neighbours (volga_agent/neighbours.py), piece by piece: which two nodes a node trades its level with, levels
that go stale, the size of a level on the wire, and where the gateway of an overloaded node sends a request. The
Agent API's side, on a real server: tests/integration/test_neighbours_api.py."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
from neighbour_levels import Fixed, level, run

from volga_agent import neighbours
from volga_agent.app import defaultmodel
from volga_agent.gateway import catalog, dataplane, links
from volga_agent.node.settings import Settings
from volga_agent.rpc.volga.v1 import agent_pb2 as pb


def test_each_node_trades_with_the_next_two_of_the_sorted_ring() -> None:
    nodes = ["node-c", "node-a", "node-d", "node-b"]
    assert neighbours.ring(nodes, "node-a") == ("node-b", "node-c")
    assert neighbours.ring(nodes, "node-c") == ("node-d", "node-a")
    assert neighbours.ring(nodes, "node-d") == ("node-a", "node-b")
    # Every node sees the same ring, whatever order its directory lists the nodes in.
    assert neighbours.ring(reversed(nodes), "node-c") == ("node-d", "node-a")
    # A node not listed yet is placed in the ring by its name; small clusters give fewer neighbours.
    assert neighbours.ring(["node-a", "node-c"], "node-b") == ("node-c", "node-a")
    assert neighbours.ring(["node-a", "node-b"], "node-a") == ("node-b",)
    assert neighbours.ring(["node-a"], "node-a") == ()
    assert neighbours.ring([], "node-a") == ()


def test_the_directory_gives_the_ring_and_nodes_without_an_address_take_no_part() -> None:
    ex = neighbours.LevelExchange("b", Fixed(level("b")))
    assert ex.neighbours() == ()
    ex.set_directory({"a": "h:1", "b": "h:2", "c": "", "d": "h:4", "e": "h:5"})
    assert ex.neighbours() == ("d", "e")
    ex.set_directory({"a": "h:1", "c": "h:3"})
    assert ex.neighbours() == ("c", "a")


def test_levels_not_heard_again_within_a_second_are_dropped() -> None:
    ex = neighbours.LevelExchange("a", Fixed(level("a")))
    assert ex.record(level("b", sequence=5), now=100.0)
    assert ex.record(level("c", sequence=1), age_ms=400, now=100.0)  # made 0.4 s before it arrived
    assert not ex.record(level("a"), now=100.0)  # never our own
    assert [h.level.node for h in ex.fresh(now=100.5)] == ["b", "c"]
    assert [h.level.node for h in ex.fresh(now=100.7)] == ["b"]  # c is 1.1 s old
    assert ex.fresh(now=101.01) == []  # and b is gone now too
    # An older level of a node does not replace a newer one, unless the newer one went stale.
    assert ex.record(level("b", load=1, sequence=7), now=200.0)
    assert not ex.record(level("b", load=9, sequence=6), now=200.1)
    assert [h.level.load for h in ex.fresh(now=200.2)] == [1]
    assert ex.record(level("b", load=3, sequence=2), now=201.5)  # b restarted long after its last level
    assert [h.level.load for h in ex.fresh(now=201.6)] == [3]


def test_own_levels_carry_a_strictly_increasing_sequence() -> None:
    ex = neighbours.LevelExchange("a", Fixed(level("somebody", sequence=0)))
    first, second = ex.own(), ex.own()
    assert first.node == "a" and second.sequence > first.sequence >= 1_700_000_000_000


def test_a_level_of_a_node_with_16_models_stays_under_1_kb() -> None:
    models = {f"resnet50-int8-variant-{i:02d}": "hot" if i % 3 else "cold" for i in range(16)}
    entries = tuple(neighbours.ModelLevel(m, h == "hot", i == 4) for i, (m, h) in enumerate(models.items()))
    big = neighbours.Level("gpu-node-0123.eu-west-1.compute.internal", "OPTIMIZE", 71.5, 12.0, entries,
                           1_760_000_000_000, "10.244.17.203:8001", "10.244.17.203:8000")
    message = neighbours.to_pb(big, age_ms=250)
    size = len(message.SerializeToString())
    print(f"level of a node with 16 models: {size} bytes")
    assert size < neighbours.MAX_LEVEL_BYTES
    assert len(message.models) == 16
    back, age = neighbours.from_pb(pb.NodeLevel.FromString(message.SerializeToString()))
    assert age == 250
    assert back.node == big.node and back.gateway == big.gateway and back.sequence == big.sequence
    assert back.gateway_http == "10.244.17.203:8000"
    assert math.isclose(back.memory_pct, 71.5) and back.state == "OPTIMIZE"
    assert {m.model_id: (m.hot, m.shed) for m in back.models} == {m.model_id: (m.hot, m.shed) for m in big.models}


def test_a_level_leaves_out_models_rather_than_grow_past_1_kb_hot_ones_kept_first() -> None:
    many = neighbours.Level("n", "ACCEPT", 1.0, 0.0, tuple(
        neighbours.ModelLevel(f"model-with-a-rather-long-name-{i:03d}", hot=i >= 60) for i in range(80)), 1, "gw:1")
    message = neighbours.to_pb(many)
    assert message.ByteSize() <= neighbours.MAX_LEVEL_BYTES
    kept = [m.model_id for m in message.models]
    assert 0 < len(kept) < 80
    assert set(kept[:20]) == {f"model-with-a-rather-long-name-{i:03d}" for i in range(60, 80)}  # the HOT ones


@pytest.mark.parametrize(("message", "error"), [
    (pb.NodeLevel(state="ACCEPT"), "level.node is required"),
    (pb.NodeLevel(node="b", models=[pb.ModelLevel(hot=True)]), r"level.models\[0\].model_id is required"),
    (pb.NodeLevel(node="b", load=float("nan")), "level.load must be a number >= 0"),
    (pb.NodeLevel(node="b", memory_pct=-1), "level.memory_pct must be a number >= 0"),
    (pb.NodeLevel(node="b", gateway="x" * 2000), "above 1024"),
])
def test_a_bad_level_is_refused_naming_the_field(message: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        neighbours.from_pb(message)


def heard(*levels: neighbours.Level, age: float = 0.0, now: float = 50.0) -> list[neighbours.Heard]:
    return [neighbours.Heard(lv, now - age) for lv in levels]


def test_the_least_loaded_neighbour_that_can_take_the_model_is_chosen() -> None:
    now = 50.0
    b = level("b", load=4, m="hot")
    c = level("c", load=1, m="cold")
    d = level("d", load=0, m="shed", other="hot")  # sheds m itself
    e = level("e", load=0, state="EMERGENCY", m="hot")  # overloaded itself
    f = level("f", load=0, other="hot")  # does not have m
    assert neighbours.choose(heard(b, c, d, e, f), "m", "a", now) == c
    assert neighbours.choose(heard(b, d, e, f), "m", "a", now) == b
    assert neighbours.choose(heard(d, e, f), "m", "a", now) is None
    assert neighbours.choose(heard(f, d, e), "other", "a", now) == d  # d sheds m, not other; d before f
    # Equal load: the one with the model HOT, then the one with less memory in use, then by name.
    assert neighbours.choose(heard(level("c", m="cold"), level("b", m="hot")), "m", "a", now).node == "b"
    assert neighbours.choose(heard(level("c", memory=5, m="hot"), level("b", memory=9, m="hot")), "m", "a",
                             now).node == "c"
    # Never itself, never a stale level, never one without a gateway to send to.
    assert neighbours.choose(heard(level("a", m="hot")), "m", "a", now) is None
    assert neighbours.choose(heard(c, age=1.5), "m", "a", now) is None
    assert neighbours.choose(heard(dataclasses.replace(c, gateway="")), "m", "a", now) is None


def plane_with(*models: str) -> dataplane.Dataplane:
    base = defaultmodel.ensure().spec
    specs = {m: base.model_copy(update={"model_id": m}) for m in models}
    return dataplane.Dataplane(catalog.Catalog(specs), links.LocalAgentLink(lambda m, h: links.Route("", "")),
                               node="a")


def test_the_gateway_passes_on_only_what_its_overloaded_node_would_refuse() -> None:
    plane = plane_with("m", "quiet")
    now = time.monotonic()
    plane.set_neighbours("ACCEPT", (neighbours.Heard(level("b", load=2, m="hot", quiet="hot"), now),
                                    neighbours.Heard(level("c", load=1, m="hot"), now)))
    with plane._lock:
        assert plane._neighbour_for("m") is None  # not overloaded: served here
    plane.shed("m", 500)
    with plane._lock:
        assert plane._neighbour_for("m").node == "c"  # shed: the least-loaded neighbour with m
        assert plane._neighbour_for("quiet") is None  # not shed, node not in EMERGENCY
    plane.set_neighbours("EMERGENCY", plane._neighbours)
    with plane._lock:
        assert plane._neighbour_for("quiet").node == "b"  # the node in EMERGENCY: every model that can go
    plane.set_neighbours("EMERGENCY", ())
    with plane._lock:
        assert plane._neighbour_for("m") is None  # no neighbour heard of: refused as before


def test_the_exchanger_hands_the_node_state_and_neighbour_levels_to_the_data_plane() -> None:
    class Plane:
        def __init__(self) -> None:
            self.calls: list[tuple[str, tuple[neighbours.Heard, ...]]] = []

        def set_batch_cap(self, model: str, cap: int | None) -> None: ...

        def shed(self, model: str, retry_after_ms: int) -> None: ...

        def unshed(self, model: str) -> None: ...

        def drain_load(self) -> dict[str, object]:
            return {}

        def set_neighbours(self, state: str, levels: tuple[neighbours.Heard, ...]) -> None:
            self.calls.append((state, levels))

    plane = Plane()
    b = (neighbours.Heard(level("b", m="hot"), 1.0),)

    async def scenario() -> None:  # a gRPC channel (the link's) wants an event loop
        link = links.GrpcAgentLink("127.0.0.1:1")
        ex = links.Exchanger(plane, link)  # type: ignore[arg-type]
        ex.apply(links.Directives(True, {}, {}, 50))
        ex.apply(links.Directives(True, {}, {}, 50, "EMERGENCY", b))
        ex.apply(links.Directives(True, {}, {}, 50, "EMERGENCY", b))
        ex.apply(links.Directives(True, {}, {}, 50, "ACCEPT", ()))
        await link.close()

    run(scenario())
    assert plane.calls == [("EMERGENCY", b), ("ACCEPT", ())]


def test_neighbour_settings() -> None:
    assert Settings().neighbours.enabled is False
    s = Settings.from_mapping({"neighboursEnabled": True, "neighboursPeriodMs": 100.0})
    assert (s.neighbours.enabled, s.neighbours.period_ms) == (True, 100.0)
    with pytest.raises(ValueError, match=r"settings\.neighbours_period_ms"):
        Settings.from_mapping({"neighboursPeriodMs": 5.0})


def test_the_agent_says_why_it_takes_no_part() -> None:
    assert neighbours.off_reason(True, True, True, True) == ""
    assert "neighboursEnabled is false" in neighbours.off_reason(False, True, True, True)
    assert "no tokens" in neighbours.off_reason(True, False, True, True)
    assert "autonomyEnabled is false" in neighbours.off_reason(True, True, False, True)
    assert "--agent-address" in neighbours.off_reason(True, True, True, False)
    assert neighbours.addresses_of(["b=10.0.0.2:8010", " c = h:1 "]) == {"b": "10.0.0.2:8010", "c": "h:1"}
    with pytest.raises(ValueError, match="--neighbour 'b': expected NODE=HOST:PORT"):
        neighbours.addresses_of(["b"])
