"""The operator's decisions, as pure functions over a state snapshot."""

from __future__ import annotations

import dataclasses
from typing import Any

from volga_core import api, nodes
from volga_core.api import conditions, labels
from volga_operator import reconcile

Tier = api.Tier
NOW = "2026-11-29T00:00:00Z"


def spec_body(**pool: int) -> dict[str, Any]:
    return {"modelId": "m", "framework": "onnx", "source": "/models/m.onnx",
            "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}],
            "pool": {"hot": 0, "frozen": 1, **pool}}


def state_with(spec: dict[str, Any] | None = None, profiles: int = 2, **record: Any) -> reconcile.State:
    state = reconcile.State()
    state.nodes = {f"n{i}": nodes.NodeProfile(f"n{i}") for i in range(profiles)}
    state.specs[("ns", "ms")] = reconcile.SpecRecord("ns", "ms", "uid-1", 3, spec or spec_body(), {},
                                                     (labels.FINALIZER,), **record)
    return state


def verbs(actions: list[reconcile.Action]) -> list[tuple[str, str]]:
    return [(a.verb, a.name) for a in actions]


def apply(state: reconcile.State, actions: list[reconcile.Action]) -> None:
    """What the API server would do with the writes, enough for the next round."""
    for a in actions:
        if a.verb == "create_emi":
            state.emis[(a.namespace, a.name)] = reconcile.EmiRecord(a.namespace, a.name, a.body["spec"], {})
        elif a.verb == "delete_emi":
            state.emis.pop((a.namespace, a.name), None)
        elif a.verb == "patch_spec_status":
            old = state.specs[(a.namespace, a.name)]
            state.specs[(a.namespace, a.name)] = reconcile.SpecRecord(
                old.namespace, old.name, old.uid, old.generation, old.spec, a.body["status"], old.finalizers)


def test_creates_emis_with_owner_labels_and_status() -> None:
    state = state_with(spec_body(hot=1, frozen=1))
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("create_emi", "ms-0"), ("create_emi", "ms-1"), ("patch_spec_status", "ms")]
    emi = actions[0].body
    assert emi["metadata"]["labels"] == {"volga.dev/modelspec": "ms", "volga.dev/node": emi["spec"]["node"]}
    assert emi["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert emi["spec"]["targetTier"] == "HOT" and actions[1].body["spec"]["targetTier"] == "FROZEN"
    assert {actions[0].body["spec"]["node"], actions[1].body["spec"]["node"]} == {"n0", "n1"}
    status = actions[2].body["status"]
    assert status["observedGeneration"] == 3 and status["instances"] == 0
    expected = api.parse_model_spec({"metadata": {"name": "x"}, "spec": spec_body()}).spec.input_hash()
    assert status["inputHash"] == expected


def test_a_second_round_writes_nothing_new() -> None:
    state = state_with()
    apply(state, reconcile.compute(state, [("ns", "ms")], NOW))
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("patch_spec_status", "ms")]  # instances 0 -> 1
    apply(state, actions)
    assert reconcile.compute(state, [("ns", "ms")], NOW) == []


def test_status_counts_tiers_and_ready() -> None:
    state = state_with()
    apply(state, reconcile.compute(state, [("ns", "ms")], NOW))
    state.emis[("ns", "ms-0")] = reconcile.EmiRecord("ns", "ms-0", state.emis[("ns", "ms-0")].spec, {
        "tier": "FROZEN", "conditions": [{"type": "Ready", "status": "True"}]})
    [action] = reconcile.compute(state, [("ns", "ms")], NOW)
    status = action.body["status"]
    assert status["tiers"]["FROZEN"] == 1 and status["tiers"]["HOT"] == 0
    assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"


def test_a_new_spec_gets_no_finalizer_but_its_emis_an_owner_reference() -> None:
    state = state_with()
    state.specs[("ns", "ms")] = reconcile.SpecRecord("ns", "ms", "u", 1, spec_body(), {})
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("create_emi", "ms-0"), ("patch_spec_status", "ms")]
    [owner] = actions[0].body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("ModelSpec", "ms", "u", True)


def test_an_emi_of_an_earlier_spec_of_the_same_name_is_replaced_not_adopted() -> None:
    state = state_with()
    apply(state, reconcile.compute(state, [("ns", "ms")], NOW))
    emi = state.emis[("ns", "ms-0")]
    state.emis[("ns", "ms-0")] = dataclasses.replace(emi, owner_uid="uid-of-the-deleted-one")
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("delete_emi", "ms-0"), ("patch_spec_status", "ms")]
    apply(state, actions)
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions)[0] == ("create_emi", "ms-0")
    assert actions[0].body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_invalid_spec_gets_a_condition_naming_the_field_and_no_emis() -> None:
    bad = spec_body()
    bad["inputs"][0]["shape"] = [0, 4]
    bad["framework"] = "tensorflow"
    state = state_with(bad)
    state.emis[("ns", "ms-0")] = reconcile.EmiRecord("ns", "ms-0", {"modelSpec": "ms"}, {})
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("delete_emi", "ms-0"), ("patch_spec_status", "ms")]
    ready = actions[1].body["status"]["conditions"][0]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.framework" in ready["message"] and "spec.inputs[0].shape" in ready["message"]


def test_unschedulable_spec_says_why() -> None:
    gpu = spec_body()
    gpu["hardware"] = {"gpu": True, "gpuProduct": "NVIDIA H200"}
    state = state_with(gpu)
    [action] = reconcile.compute(state, [("ns", "ms")], NOW)
    ready = action.body["status"]["conditions"][0]
    assert ready["reason"] == "Unschedulable" and "2 node(s): no GPU" in ready["message"]


def test_deletion_removes_emis_then_the_finalizer() -> None:
    state = state_with()
    apply(state, reconcile.compute(state, [("ns", "ms")], NOW))
    old = state.specs[("ns", "ms")]
    state.specs[("ns", "ms")] = reconcile.SpecRecord("ns", "ms", old.uid, old.generation, old.spec, old.status,
                                                     old.finalizers, deleting=True)
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("delete_emi", "ms-0")]
    apply(state, actions)
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    assert verbs(actions) == [("patch_spec_meta", "ms")] and actions[0].body["metadata"]["finalizers"] == []


def test_lost_node_moves_its_emis() -> None:
    state = state_with(spec_body(frozen=2))
    apply(state, reconcile.compute(state, [("ns", "ms")], NOW))
    lost = state.emis[("ns", "ms-0")].spec["node"]
    state.nodes[lost] = nodes.NodeProfile(lost, ready=False)
    actions = reconcile.compute(state, [("ns", "ms")], NOW)
    [patch] = [a for a in actions if a.verb == "patch_emi"]
    assert patch.name == "ms-0" and patch.body["spec"]["node"] != lost
    assert patch.body["metadata"]["labels"]["volga.dev/node"] == patch.body["spec"]["node"]


def test_orphans_of_a_vanished_spec_are_deleted() -> None:
    state = reconcile.State()
    state.emis[("ns", "gone-0")] = reconcile.EmiRecord("ns", "gone-0", {"modelSpec": "gone"}, {})
    assert verbs(reconcile.compute(state, [("ns", "gone")], NOW)) == [("delete_emi", "gone-0")]


def test_node_profiles_need_the_agent_annotation() -> None:
    assert reconcile.node_profile("n", {}, []) is None
    annotations = nodes.NodeProfile("n", 8, "NVIDIA H200", 1, (0,)).annotations()
    profile = reconcile.node_profile("n", annotations, [{"type": "Ready", "status": "False"}])
    assert profile is not None and profile.gpu_count == 8 and not profile.ready


def test_conditions_keep_their_transition_time() -> None:
    first = conditions.condition("Ready", True, "R", "", [], "t1")
    assert conditions.condition("Ready", True, "R", "m", [first], "t2")["lastTransitionTime"] == "t1"
    assert conditions.condition("Ready", False, "R", "", [first], "t2")["lastTransitionTime"] == "t2"


def test_observed_ages_come_from_the_agents_last_used() -> None:
    """The planner's recency score needs how long ago each EMI was used; agents report status.lastUsed."""
    state = state_with()
    state.emis[("ns", "ms-0")] = reconcile.EmiRecord("ns", "ms-0", {"modelSpec": "ms", "node": "n1"},
                                                     {"lastUsed": "2026-01-01T00:00:00Z", "snapshotBytes": 7})
    state.emis[("ns", "ms-1")] = reconcile.EmiRecord("ns", "ms-1", {"modelSpec": "ms", "node": "n2"}, {})
    ages = {o.name: (o.node, o.last_used_age_s, o.snapshot_bytes)
            for o in reconcile.observed(state, "2026-01-01T00:01:30Z")}
    assert ages == {"ns/ms-0": ("n1", 90.0, 7), "ns/ms-1": ("n2", None, 0)}


def test_the_operator_loop_assumes_its_emi_patches() -> None:
    """A patch that succeeded is reflected at once, so a pass before its watch event does not send it again."""
    from volga_operator import loop as reconcile_loop

    loop = reconcile_loop.Loop()
    loop.state = state_with()
    apply(loop.state, reconcile.compute(loop.state, [("ns", "ms")], NOW))
    emi = loop.state.emis[("ns", "ms-0")]
    loop.state.emis[("ns", "ms-0")] = reconcile.EmiRecord("ns", "ms-0", {**emi.spec, "targetTier": "HOT"}, {})
    [patch] = [a for a in reconcile.compute(loop.state, [("ns", "ms")], NOW) if a.verb == "patch_emi"]
    loop._assume(patch)
    assert [a for a in reconcile.compute(loop.state, [("ns", "ms")], NOW) if a.verb == "patch_emi"] == []


def test_a_spec_that_leaves_its_signature_out_is_placed_as_written() -> None:
    # The operator cannot open node-local model files: it places the spec, and the nodes read the signature.
    body = spec_body()
    del body["inputs"], body["outputs"]
    actions = reconcile.compute(state_with(body), [("ns", "ms")], NOW)
    assert verbs(actions) == [("create_emi", "ms-0"), ("patch_spec_status", "ms")]
    status = actions[1].body["status"]
    assert status["inputHash"] == "" and {c["type"]: c["status"] for c in status["conditions"]}["Valid"] == "True"
