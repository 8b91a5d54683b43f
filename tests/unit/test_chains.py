"""Chains of models, the pure parts: declaration checks (per ModelSpec and across a store), placement as one,
and the idle rule that treats a chain as one model."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import yaml

from volga_agent import cli
from volga_agent.node import chains, policy
from volga_agent.node.settings import Settings
from volga_bench import chain as bench_chain
from volga_core import api, nodes, planner
from volga_operator import reconcile

Tier = api.Tier


def spec(model_id: str, chain: tuple[str, ...] = (), ensemble: str | None = None, inputs: str = "x",
         outputs: str = "y", gpu: bool = False, min_gib: float = 0, dtype: str = "FP32", **pool: int
         ) -> api.ModelSpecSpec:
    document: dict[str, Any] = {
        "modelId": model_id, "framework": "onnx", "source": "/m.onnx", "chain": list(chain),
        "inputs": [{"name": inputs, "dtype": dtype, "shape": [-1, 4]}],
        "outputs": [{"name": outputs, "dtype": "FP32", "shape": [-1, 4]}],
        "hardware": {"gpu": gpu, "minMemoryGiB": min_gib},
        "pool": {"hot": 0, "warm": 0, "suspended": 0, "frozen": 1, **pool}}
    if ensemble is not None:
        document["ensemble"] = ensemble
    return api.ModelSpecSpec.model_validate(document)


def ocr() -> dict[str, api.ModelSpecSpec]:
    return {"det": spec("det", ("rec", "fields"), "ocr", outputs="boxes"),
            "rec": spec("rec", inputs="boxes", outputs="text"),
            "fields": spec("fields", inputs="text", outputs="fields")}


# --- declaration -------------------------------------------------------------------------------------------------


def test_a_well_formed_chain_has_no_problems() -> None:
    assert api.chain_problems(ocr()) == {}


@pytest.mark.parametrize("chain, ensemble, path, reason", [
    (["b", "a"], None, "spec.chain[1]", "'a' is this model's own modelId: a chain that calls its head again"),
    (["b", "b"], None, "spec.chain[1]", "'b' is listed twice"),
    (["B"], None, "spec.chain[0]", "'B': a model id must be 1-63 lowercase"),
    ([f"m{i}" for i in range(17)], None, "spec.chain", "at most 16 items"),
    ([], "e", "spec.ensemble", "an ensemble serves a chain"),
    (["b"], "a", "spec.ensemble", "the head's own modelId"),
])
def test_one_modelspec_refuses_a_malformed_chain(chain: list[str], ensemble: str | None, path: str,
                                                 reason: str) -> None:
    document = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": "a"},
                "spec": {"modelId": "a", "framework": "onnx", "source": "/m.onnx", "chain": chain,
                         **({"ensemble": ensemble} if ensemble else {})}}
    with pytest.raises(api.SpecError) as info:
        api.parse_model_spec(document)
    assert [(p, r) for p, r in info.value.problems if p == path and reason in r], info.value.problems


def test_unknown_members_cycles_and_models_in_two_chains_name_their_field() -> None:
    found = api.chain_problems({"a": spec("a", ("b", "z")), "b": spec("b", ("a",)), "c": spec("c", ("d",)),
                                "d": spec("d"), "e": spec("e", ("d",), "c"), "f": spec("f", ("c",))})
    assert found["a"] == [("spec.chain[0]", "a -> b -> a is a cycle: a chain runs one way"),
                          ("spec.chain[1]", "no ModelSpec has modelId 'z'")]
    assert found["b"] == [("spec.chain[0]", "b -> a -> b is a cycle: a chain runs one way")]
    assert found["e"] == [
        ("spec.chain[0]", "'d' is already in the chain headed by 'c' (c): a model is in one chain at most"),
        ("spec.ensemble", "'c' is the modelId of the ModelSpec in c")]
    assert found["f"] == [("spec.chain[0]", "'c' heads a chain of its own (c): a model is in one chain at most "
                                            "(list its members here instead)")]
    assert "c" not in found and "d" not in found


def test_an_ensemble_needs_each_input_from_before_it() -> None:
    specs = ocr() | {"rec": spec("rec", inputs="crops", outputs="text")}
    assert api.chain_problems(specs) == {"det": [(
        "spec.chain[0]", "input 'crops' of 'rec' is neither an input of the head nor an output of a model before it "
                         "(those are 'x', 'boxes')")]}
    specs = ocr() | {"fields": spec("fields", inputs="text", dtype="INT64", outputs="fields")}
    assert api.chain_problems(specs) == {"det": [(
        "spec.chain[1]", "input 'text' of 'fields' is INT64 [-1, 4], and the output of 'rec' 'text' is FP32 [-1, 4]")]}
    # Without an ensemble the client passes the tensors itself: names need not match.
    assert api.chain_problems(specs | {"det": spec("det", ("rec", "fields"), outputs="boxes")}) == {}


def test_the_operator_marks_a_chain_with_an_unknown_member_invalid() -> None:
    state = reconcile.State()
    for name, s in {"det": spec("det", ("rec", "nope")), "rec": spec("rec")}.items():
        state.specs[("ns", name)] = reconcile.SpecRecord("ns", name, "uid", 1, s.to_wire(), {}, (), False)
    actions = reconcile.compute(state, [("ns", "det")], now="2025-01-01T00:00:00Z")
    [status] = [a for a in actions if a.verb == "patch_spec_status" and a.name == "det"]
    valid = next(c for c in status.body["status"]["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and valid["message"] == "spec.chain[1]: no ModelSpec has modelId 'nope'"
    assert not [a for a in actions if a.verb == "create_emi" and a.name.startswith("det")]


# --- placement ---------------------------------------------------------------------------------------------------


def test_a_chain_lands_on_one_node_and_one_gpu() -> None:
    profiles = [nodes.NodeProfile(f"n{i}", 4, "NVIDIA H200", 141 * 2**30) for i in range(3)]
    specs = {name: spec(s.model_id, tuple(s.chain), gpu=True, min_gib=20, inputs=s.inputs[0].name,
                        outputs=s.outputs[0].name) for name, s in ocr().items()}
    busy = [planner.Observed(f"other-{i}", "other", "n0") for i in range(3)]
    result = planner.plan(specs, profiles, busy)
    assert {(d.node, d.gpu_index) for d in result.desired} == {("n1", 0)}
    assert sorted(d.name for d in result.desired) == ["det-0", "fields-0", "rec-0"]


def test_a_chain_too_large_for_one_gpu_spreads_over_the_node_gpus() -> None:
    node = nodes.NodeProfile("n0", 4, "NVIDIA A10", 24 * 2**30)
    specs = {name: spec(s.model_id, tuple(s.chain), gpu=True, min_gib=10) for name, s in ocr().items()}
    result = planner.plan(specs, [node])
    assert {d.node for d in result.desired} == {"n0"}
    assert sorted(d.gpu_index for d in result.desired) == [0, 1, 2]


def test_without_a_chain_the_same_models_spread_over_nodes() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(3)]
    alone = {name: spec(s.model_id) for name, s in ocr().items()}
    assert len({d.node for d in planner.plan(alone, profiles).desired}) == 3
    assert len({d.node for d in planner.plan(ocr(), profiles).desired}) == 1


def test_a_chain_follows_the_node_most_members_already_use() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(3)]
    observed = [planner.Observed("rec-0", "rec", "n2"), planner.Observed("fields-0", "fields", "n2"),
                planner.Observed("det-0", "det", "n0")]
    assert {d.node for d in planner.plan(ocr(), profiles, observed).desired} == {"n2"}


def test_each_replica_of_a_chain_is_whole_on_its_node() -> None:
    profiles = [nodes.NodeProfile(f"n{i}") for i in range(2)]
    specs = {name: spec(s.model_id, tuple(s.chain), frozen=2) for name, s in ocr().items()}
    by_index: dict[str, set[str]] = {}
    for d in planner.plan(specs, profiles).desired:
        by_index.setdefault(d.name.rsplit("-", 1)[1], set()).add(d.node)
    assert sorted(len(n) for n in by_index.values()) == [1, 1] and by_index["0"] != by_index["1"]


def test_a_chain_no_node_can_hold_is_not_placed() -> None:
    specs = ocr() | {"rec": spec("rec", inputs="boxes", outputs="text", gpu=True)}
    result = planner.plan(specs, [nodes.NodeProfile("cpu-0")])
    assert result.desired == ()
    assert set(result.unplaced) == {"det", "rec", "fields"}
    assert result.unplaced["det"] == "no node is eligible for every model of its chain (cpu-0: rec: no GPU)"


# --- the idle rule -----------------------------------------------------------------------------------------------


def view(name: str, model: str, last_used: float, chain: str = "", busy: bool = False) -> policy.InstanceView:
    return policy.InstanceView(name, model, Tier.HOT, False, last_used, busy=busy, chain=chain)


def test_a_member_is_not_demoted_while_another_is_in_use() -> None:
    settings = Settings(hot_idle_sec=10, warm_idle_sec=10, suspended_idle_sec=10)
    views = [view("det-0", "det", 0.0, "det"), view("rec-0", "rec", 95.0, "det"), view("solo-0", "solo", 0.0)]
    moves = policy.plan_demotions(views, settings, 100.0, policy.Usage())
    assert [m.instance for m in moves] == ["solo-0"]
    busy = [view("det-0", "det", 0.0, "det"), view("rec-0", "rec", 0.0, "det", busy=True)]
    assert policy.plan_demotions(busy, settings, 100.0, policy.Usage()) == []
    idle = [view("det-0", "det", 0.0, "det"), view("rec-0", "rec", 80.0, "det")]
    assert [m.instance for m in policy.plan_demotions(idle, settings, 100.0, policy.Usage())] == ["det-0", "rec-0"]


def test_chains_of_a_store() -> None:
    found = chains.Chains.of(ocr().values())
    assert found.members("rec") == ("det", "rec", "fields")
    assert found.peers("fields") == ("det", "rec")
    assert found.head("rec") == "det"
    assert found.members("solo") == ("solo",) and found.peers("solo") == () and found.head("solo") == ""


# --- volga validate and volga up ---------------------------------------------------------------------------------


def test_validate_and_up_name_the_chain_field(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs = bench_chain.model_specs(bench_chain.build_models(tmp_path), "c", True)
    head = specs[0].to_wire()
    head["spec"]["chain"] = ["c-recognize", "c-nope"]
    documents = [head, *(s.to_wire() for s in specs[1:])]
    path = tmp_path / "chain.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    assert cli.main(["validate", "-f", str(path)]) == 1
    assert f"{path}#0: invalid ModelSpec\n  spec.chain[1]: no ModelSpec has modelId 'c-nope'" in capsys.readouterr().err
    assert cli.main(["up", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "-f", str(path)]) == 2
    assert "spec.chain[1]: no ModelSpec has modelId 'c-nope'" in capsys.readouterr().err
    path.write_text(yaml.safe_dump_all(s.to_wire() for s in specs))
    assert cli.main(["validate", "-f", str(path)]) == 0


def test_the_operator_plans_a_chain_with_the_member_that_changed() -> None:
    state = reconcile.State()
    for name, s in ocr().items():
        state.specs[("ns", name)] = reconcile.SpecRecord("ns", name, "uid", 1, s.to_wire(), {}, (), False)
    state.nodes = {f"n{i}": nodes.NodeProfile(f"n{i}") for i in range(3)}
    actions = reconcile.compute(state, [("ns", "rec")], now="2025-01-01T00:00:00Z")
    created = {a.body["spec"]["modelId"]: a.body["spec"]["node"] for a in actions if a.verb == "create_emi"}
    assert set(created) == {"det", "rec", "fields"} and len(set(created.values())) == 1


def test_a_member_added_to_a_placed_chain_joins_its_node() -> None:
    """Members already placed are not planned alone (the operator's shortcut for specs whose EMIs stay put): a new
    member is planned with them, so it lands on their node and they stay."""
    state = reconcile.State()
    specs = ocr()
    for name, s in specs.items():
        state.specs[("ns", name)] = reconcile.SpecRecord("ns", name, "uid", 1, s.to_wire(), {}, (), False)
    state.nodes = {f"n{i}": nodes.NodeProfile(f"n{i}") for i in range(5)}
    first = [a for a in reconcile.compute(state, [("ns", n) for n in specs], now="2025-01-01T00:00:00Z")
             if a.verb == "create_emi"]
    for action in first:
        if action.body["spec"]["modelId"] != "fields":  # the chain's last member arrives later
            record = reconcile.EmiRecord.from_body({**action.body, "metadata": {**action.body["metadata"],
                                                                               "namespace": "ns"}})
            state.emis[("ns", record.name)] = record
    node = {a.body["spec"]["node"] for a in first}
    assert len(node) == 1
    for i in range(1, 5):  # the other nodes look better now: fresher, emptier
        state.nodes = {**state.nodes, f"n{i}": nodes.NodeProfile(f"n{i}")}
    again = reconcile.compute(state, [("ns", "fields")], now="2025-01-02T00:00:00Z")
    created = {a.body["spec"]["modelId"]: a.body["spec"]["node"] for a in again if a.verb == "create_emi"}
    assert created == {"fields": node.pop()}
    assert not [a for a in again if a.verb in ("delete_emi", "patch_emi")]
