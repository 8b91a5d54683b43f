"""The cluster tier's decisions as pure functions: the agents' published autonomy states (fresh or stale, time in
state on either side's clock), EMERGENCY nodes avoided by the planner, a chain moved off a node that stayed in
EMERGENCY (all members together, to a node not in EMERGENCY, once per period), the chain registry in the head's
status, and the watermarks published to the agents. The proof on a real API server is test_cluster_tier_k8s.py."""

from __future__ import annotations

from typing import Any

import pytest

from volga_agent.node.settings import Settings
from volga_core import api, nodes, planner
from volga_core.api import conditions, labels
from volga_operator import reconcile

NOW = "2026-11-29T00:10:00Z"
CLOCK = conditions.unix(NOW) or 0.0
NS = "ns"


def spec_body(model_id: str, chain: list[str] | None = None, frozen: int = 1) -> dict[str, Any]:
    return {"modelId": model_id, "framework": "onnx", "source": "/models/m.onnx",
            "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}],
            "pool": {"hot": 0, "frozen": frozen}, **({"chain": chain} if chain else {})}


def heard(state: str, in_state_for: float, age: float = 1.0, memory: float = 90.0, period: float = 5.0,
          skew: float = 0.0) -> reconcile.Heard:
    """A node's record: in `state` for `in_state_for` seconds, its last heartbeat received `age` seconds ago; the
    agent's clock runs `skew` seconds ahead of the operator's."""
    beat = CLOCK - age + skew
    return reconcile.Heard(nodes.NodeAutonomy(state, beat - (in_state_for - age), beat, memory, period),
                           CLOCK - age)


def chain_state(nodes_count: int = 3, **tier: float) -> reconcile.State:
    """A chain det -> rec -> fields (one FROZEN instance each) placed on n0, a model in no chain beside it."""
    state = reconcile.State(tier=reconcile.TierSettings(**tier))
    state.nodes = {f"n{i}": nodes.NodeProfile(f"n{i}") for i in range(nodes_count)}
    for name, body in (("det", spec_body("det", ["rec", "fields"])), ("rec", spec_body("rec")),
                       ("fields", spec_body("fields")), ("alone", spec_body("alone"))):
        state.specs[(NS, name)] = reconcile.SpecRecord(NS, name, f"uid-{name}", 1, body, {}, (labels.FINALIZER,))
        spec = {"modelSpec": name, "modelId": name, "node": "n0", "targetTier": "FROZEN"}
        state.emis[(NS, f"{name}-0")] = reconcile.EmiRecord(NS, f"{name}-0", spec, {"tier": "FROZEN"})
    return state


def apply(state: reconcile.State, actions: list[reconcile.Action]) -> None:
    for a in actions:
        if a.verb in ("create_emi", "patch_emi"):
            state.emis[(a.namespace, a.name)] = reconcile.EmiRecord(a.namespace, a.name, a.body["spec"], {})
        elif a.verb == "patch_spec_status":
            old = state.specs[(a.namespace, a.name)]
            state.specs[(a.namespace, a.name)] = reconcile.SpecRecord(
                old.namespace, old.name, old.uid, old.generation, old.spec, a.body["status"], old.finalizers)


def nodes_of(state: reconcile.State) -> dict[str, str]:
    return {e.owner: e.node for e in state.emis.values()}


def moved_to(actions: list[reconcile.Action]) -> dict[str, str]:
    return {a.name: a.body["spec"]["node"] for a in actions if a.verb == "patch_emi"}


def events(actions: list[reconcile.Action]) -> list[reconcile.Action]:
    return [a for a in actions if a.verb == "create_event"]


def all_keys(state: reconcile.State) -> list[reconcile.Key]:
    return sorted(state.specs)


# --- what the agents publish -----------------------------------------------------------------------------------


def test_the_annotation_round_trips_and_garbage_reads_as_none() -> None:
    published = nodes.NodeAutonomy("EMERGENCY", 100.5, 130.25, 91.26, 5.0)
    annotations = {labels.AUTONOMY_KEY: published.annotation()}
    assert nodes.NodeAutonomy.from_annotations(annotations) == dataclass_rounded(published)
    for bad in ("", "{", "[]", '{"state": "EMERGENCY"}', '{"state": "X", "since": "soon", "heartbeat": 1}'):
        assert nodes.NodeAutonomy.from_annotations({labels.AUTONOMY_KEY: bad}) is None
    assert nodes.NodeAutonomy.from_annotations(None) is None
    marks = nodes.ClusterWatermarks(55.5, 91.0, 3, 1)
    assert nodes.ClusterWatermarks.from_json(marks.to_json()) == marks
    assert nodes.ClusterWatermarks.from_json("not json") is None


def dataclass_rounded(a: nodes.NodeAutonomy) -> nodes.NodeAutonomy:
    return nodes.NodeAutonomy(a.state, round(a.since, 3), round(a.heartbeat, 3), round(a.memory_pct, 1),
                                a.period_sec)


def test_a_heartbeat_counts_from_when_the_operator_received_it_whatever_the_agents_clock() -> None:
    ahead = nodes.NodeAutonomy("EMERGENCY", since=10_000.0, heartbeat=10_020.0)  # the agent's clock: far ahead
    first = reconcile.hear(None, ahead, now=500.0)
    assert first is not None and first.received == 500.0  # never later than now
    assert first.in_state_for(500.0) == 20.0 and first.in_state_for(510.0) == 30.0
    assert reconcile.hear(first, ahead, now=520.0) == first  # the same heartbeat again (a relist): no news
    later = reconcile.hear(first, nodes.NodeAutonomy("EMERGENCY", 10_000.0, 10_025.0), now=526.0)
    assert later is not None and later.received == 526.0 and later.in_state_for(526.0) == 25.0
    assert reconcile.hear(later, None, now=530.0) is None  # the annotation is gone
    # Fresh for three periods after it was received, then stale.
    assert later.fresh(526.0 + 15.0) and not later.fresh(526.0 + 15.1)


# --- the planner -------------------------------------------------------------------------------------------------


def test_the_planner_avoids_emergency_nodes_for_new_instances_only() -> None:
    spec = api.validate_spec(spec_body("m", frozen=2))[0]
    assert spec is not None
    profiles = [nodes.NodeProfile("a"), nodes.NodeProfile("b")]
    assert {d.node for d in planner.plan({"m": spec}, profiles).desired} == {"a", "b"}
    assert {d.node for d in planner.plan({"m": spec}, profiles, avoid=frozenset({"a"})).desired} == {"b"}
    # With no other node, an avoided one still takes them; an instance already there stays.
    assert {d.node for d in planner.plan({"m": spec}, profiles[:1], avoid=frozenset({"a"})).desired} == {"a"}
    kept = planner.plan({"m": spec}, profiles, [planner.Observed("m-0", "m", "a")], avoid=frozenset({"a"}))
    assert [(d.name, d.node) for d in kept.desired] == [("m-0", "a"), ("m-1", "b")]


def test_a_new_chain_goes_to_a_node_not_in_emergency() -> None:
    state = chain_state()
    state.emis.clear()
    state.autonomy = {"n0": heard("EMERGENCY", 1.0), "n1": heard("EMERGENCY", 1.0), "n2": heard("ACCEPT", 100.0)}
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    created = {a.name: a.body["spec"]["node"] for a in actions if a.verb == "create_emi"}
    assert created["det-0"] == created["rec-0"] == created["fields-0"] == "n2"


# --- the move ----------------------------------------------------------------------------------------------------


def test_a_chain_leaves_a_node_in_emergency_past_the_setting_all_members_together() -> None:
    state = chain_state(migrate_after_sec=30.0)
    state.autonomy = {"n0": heard("EMERGENCY", 31.0, memory=93.4), "n1": heard("EMERGENCY", 50.0),
                      "n2": heard("PRELOAD", 100.0)}
    assert reconcile.due_nodes(state, CLOCK).keys() == {"n0", "n1"}
    assert reconcile.chains_on(state, ["n0"]) == {(NS, "det"), (NS, "rec"), (NS, "fields")}  # not `alone`
    actions = reconcile.compute(state, [(NS, "rec")], NOW, settle=True)
    # One re-plan of the chain's EMIs: the same names, patched to the one node not in EMERGENCY.
    assert moved_to(actions) == {"det-0": "n2", "rec-0": "n2", "fields-0": "n2"}
    [event] = events(actions)
    assert event.name == "det" and event.body["reason"] == reconcile.REASON_CHAIN_MIGRATED
    assert event.body["related"]["name"] == "n0" and event.body["involvedObject"]["uid"] == "uid-det"
    assert "from n0 to n2" in event.body["message"] and "EMERGENCY for 31 s" in event.body["message"]
    [status] = [a.body["status"] for a in actions if a.verb == "patch_spec_status" and a.name == "det"]
    chain = status["chain"]
    assert chain["members"] == ["det", "rec", "fields"] and chain["node"] == "n2" and chain["nodes"] == ["n2"]
    assert chain["migrations"] == 1 and chain["lastMigration"]["fromNode"] == "n0"
    assert chain["lastMigration"]["toNode"] == "n2" and chain["lastMigration"]["time"] == NOW
    api.ModelSpecStatus.model_validate(status)  # what the CRD's schema holds
    apply(state, actions)
    assert nodes_of(state) == {"det": "n2", "rec": "n2", "fields": "n2", "alone": "n0"}  # the rest stays
    again = reconcile.compute(state, all_keys(state), NOW, settle=True)  # done: nothing more moves
    assert not moved_to(again) and not events(again)


def test_no_move_before_the_setting_nor_on_a_stale_heartbeat() -> None:
    state = chain_state(migrate_after_sec=30.0)
    state.autonomy = {"n0": heard("EMERGENCY", 29.0)}
    assert not reconcile.due_nodes(state, CLOCK)
    assert not moved_to(reconcile.compute(state, all_keys(state), NOW, settle=True))
    # A heartbeat older than three periods: the agent may be gone; it says nothing, not EMERGENCY.
    state.autonomy = {"n0": heard("EMERGENCY", 600.0, age=16.0, period=5.0)}
    assert not reconcile.emergencies(state, CLOCK) and not reconcile.due_nodes(state, CLOCK)
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    assert not moved_to(actions) and not events(actions)
    # ... nor does it keep new instances away.
    state.emis.clear()
    created = {a.body["spec"]["node"] for a in reconcile.compute(state, [(NS, "alone")], NOW) if a.verb == "create_emi"}
    assert created == {"n0"}
    # A node whose agent publishes no autonomy at all is a fine target.
    assert reconcile.watermarks(state, CLOCK) == nodes.ClusterWatermarks()


def test_no_flapping_a_chain_moves_at_most_once_per_period() -> None:
    state = chain_state(migrate_after_sec=30.0, min_interval_sec=300.0)
    state.autonomy = {"n0": heard("EMERGENCY", 100.0), "n1": heard("ACCEPT", 100.0)}
    apply(state, reconcile.compute(state, all_keys(state), NOW, settle=True))
    assert nodes_of(state)["det"] == "n1"
    # Now n1 is in EMERGENCY and n0 calm again: within the period the chain stays where it is.
    state.autonomy = {"n0": heard("ACCEPT", 100.0), "n1": heard("EMERGENCY", 100.0)}
    assert reconcile.due_nodes(state, CLOCK).keys() == {"n1"}
    assert not moved_to(reconcile.compute(state, all_keys(state), NOW, settle=True))
    later = conditions.timestamp(CLOCK + 301)
    state.autonomy = {n: reconcile.Heard(h.autonomy, h.received + 301) for n, h in state.autonomy.items()}
    actions = reconcile.compute(state, all_keys(state), later, settle=True)
    assert len(set(moved_to(actions).values())) == 1 and moved_to(actions).keys() == {"det-0", "rec-0", "fields-0"}
    assert "n1" not in moved_to(actions).values()
    [status] = [a.body["status"] for a in actions if a.verb == "patch_spec_status" and a.name == "det"]
    assert status["chain"]["migrations"] == 2 and status["chain"]["lastMigration"]["time"] == later


def test_a_chain_with_nowhere_to_go_stays() -> None:
    state = chain_state(nodes_count=2)
    state.autonomy = {"n0": heard("EMERGENCY", 100.0), "n1": heard("EMERGENCY", 5.0)}  # n1: EMERGENCY, not due
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    assert not moved_to(actions) and not events(actions)
    assert not [a for a in actions if a.verb == "delete_emi"]
    # A chain whose models need a GPU that no other node has stays too.
    state = chain_state(nodes_count=2)
    state.nodes["n0"] = nodes.NodeProfile("n0", gpu_count=1, gpu_memory_bytes=2**34)
    for name in ("det", "rec", "fields"):
        old = state.specs[(NS, name)]
        state.specs[(NS, name)] = reconcile.SpecRecord(NS, name, old.uid, 1, {**old.spec, "hardware": {"gpu": True}},
                                                       {}, old.finalizers)
    state.autonomy = {"n0": heard("EMERGENCY", 100.0)}
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    assert set(moved_to(actions).values()) <= {"n0"} and not events(actions)  # (a GPU index is set, no move)


def test_only_the_instances_on_the_node_in_emergency_move() -> None:
    state = chain_state(migrate_after_sec=30.0)
    for name in ("det", "rec", "fields"):  # a second instance of each, on n1
        state.specs[(NS, name)] = dataclass_replace_pool(state.specs[(NS, name)], 2)
        spec = {"modelSpec": name, "modelId": name, "node": "n1", "targetTier": "FROZEN"}
        state.emis[(NS, f"{name}-1")] = reconcile.EmiRecord(NS, f"{name}-1", spec, {"tier": "FROZEN"})
    state.autonomy = {"n0": heard("EMERGENCY", 40.0)}
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    moves = moved_to(actions)
    [to] = set(moves.values())
    assert moves.keys() == {"det-0", "rec-0", "fields-0"} and to != "n0"  # the K=1 instances stay on n1
    [status] = [a.body["status"] for a in actions if a.verb == "patch_spec_status" and a.name == "det"]
    assert status["chain"]["nodes"] == [to, "n1"] and status["chain"]["node"] == to


def dataclass_replace_pool(record: reconcile.SpecRecord, frozen: int) -> reconcile.SpecRecord:
    return reconcile.SpecRecord(record.namespace, record.name, record.uid, record.generation,
                                {**record.spec, "pool": {"hot": 0, "frozen": frozen}}, record.status,
                                record.finalizers)


def test_the_chain_registry_is_in_the_heads_status_without_a_move() -> None:
    state = chain_state()
    actions = reconcile.compute(state, all_keys(state), NOW, settle=True)
    statuses = {a.name: a.body["status"] for a in actions if a.verb == "patch_spec_status"}
    assert statuses["det"]["chain"] == {"members": ["det", "rec", "fields"], "node": "n0", "nodes": ["n0"],
                                        "migrations": 0}
    assert "chain" not in statuses["rec"] and "chain" not in statuses["alone"]


def test_watermarks_are_over_the_fresh_heartbeats() -> None:
    state = chain_state()
    state.autonomy = {"n0": heard("EMERGENCY", 1.0, memory=90.0), "n1": heard("ACCEPT", 1.0, memory=41.0),
                      "n2": heard("PRELOAD", 1.0, memory=10.0, age=60.0)}
    assert reconcile.watermarks(state, CLOCK) == nodes.ClusterWatermarks(65.5, 90.0, 2, 1)


def test_the_heartbeat_setting_is_checked() -> None:
    assert Settings.from_mapping({"autonomyHeartbeatSec": 1.0}).autonomy.heartbeat_sec == 1.0
    with pytest.raises(ValueError, match=r"settings\.autonomy_heartbeat_sec: .*0\.5"):
        Settings.from_mapping({"autonomyHeartbeatSec": 0.1})
