"""What a warm-up finds, without a worker: a made-up warm-up the model refuses is skipped (declared samples still
fail), answers that contradict the declared outputs and the shape metadata says instead, the EMI conditions built
from them, the gateway catalog's outputs, `volga status`'s notices; and `volga inspect`'s probe: the dynamic
dimensions, the ladder of sizes and the first one a model runs. Real models through real workers:
tests/integration/test_real_model_shapes.py."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from volga_agent.app import status as status_view
from volga_agent.cluster import sync
from volga_agent.gateway import catalog
from volga_agent.node import pool, probe
from volga_agent.worker import contract, warmup
from volga_core import api

NOW = "2026-12-01T00:00:00Z"


def seen(declared: tuple[int, ...], *answers: tuple[int, ...]) -> contract.OutputSeen:
    return contract.OutputSeen("y", declared, answers)


@pytest.mark.parametrize(("output", "contradicts", "answered"), [
    (seen((-1, 4), (1, 4)), False, (-1, 4)),
    (seen((-1, -1), (1, 7), (2, 9)), False, (-1, -1)),
    (seen((-1, 4), (1, 4, 1)), True, (-1, 4, 1)),  # the batch dimension stays any size
    (seen((-1, 4), (1, 4, 3), (2, 4, 5)), True, (-1, 4, -1)),  # sizes that differ between answers: any
    (seen((2, 4), (2, 5)), True, (2, 5)),  # a fixed size answered otherwise
    (seen((-1, 3), (1, 3, 0)), True, (-1, 3, -1)),  # no rows this time says nothing of the size
    (seen((-1, 4), (1, 4, 1), (1, 4)), True, None),  # answers of different ranks: no one shape
])
def test_an_output_contradicts_its_declaration_and_says_what_it_answers(
        output: contract.OutputSeen, contradicts: bool, answered: tuple[int, ...] | None) -> None:
    assert output.contradicts is contradicts
    assert output.answered == answered


def test_the_report_names_each_contradiction_and_travels_as_json() -> None:
    report = contract.WarmupReport(outputs=(seen((-1, 4), (1, 4, 1)), contract.OutputSeen("ok", (-1,), ((1,),))))
    assert report.mismatch == ("the model's answers contradict its declared outputs: output 'y': declared [-1, 4], "
                               "the model answered [1, 4, 1]")
    assert report.answered == (("y", (-1, 4, 1)),)
    assert contract.WarmupReport.from_wire(report.to_wire()) == report
    assert contract.WarmupReport().mismatch == "" and contract.WarmupReport().answered == ()


def config(**fields: Any) -> contract.WorkerConfig:
    return contract.WorkerConfig("m", "onnx", "/m.onnx", (contract.TensorDecl("x", "FP32", (-1, 1, -1)),),
                                 (contract.TensorDecl("y", "FP32", (-1, 4)),), "/s", "/d", **fields)


def conv(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A convolution of width 5 over the last dimension: refuses fewer than 5 samples; answers rank 3."""
    width = inputs["x"].shape[-1]
    if width < 5:
        raise ValueError(f"Invalid input shape: {{{width}}}")
    return {"y": np.zeros((inputs["x"].shape[0], 4, width - 4), np.float32)}


def test_a_refused_made_up_warm_up_is_skipped_with_the_reason() -> None:
    warm, report = warmup.warm_up(conv, config(warmup_iterations=2))
    assert warm == [] and report.outputs == ()
    assert report.skipped.startswith("the model refused the made-up warm-up inputs, so it serves without a warm-up "
                                     "(warm-up with made-up inputs (declare runtime.warmup to give real ones; input "
                                     "'x' shape [1, 1, 1]): ValueError: Invalid input shape: {1}); declare "
                                     "runtime.warmup")


def test_a_refused_declared_sample_still_fails_and_one_that_runs_reports_the_answers() -> None:
    refused = (contract.WarmupSample((contract.WarmupTensor("x", (1, 1, 3)),)),)
    with pytest.raises(warmup.WarmupError, match=r"^warm-up sample 0 \(input 'x' shape \[1, 1, 3\]\): ValueError"):
        warmup.warm_up(conv, config(warmup=refused))
    runs = (contract.WarmupSample((contract.WarmupTensor("x", (1, 1, 8)),)),
            contract.WarmupSample((contract.WarmupTensor("x", (2, 1, 9)),)))
    warm, report = warmup.warm_up(conv, config(warmup=runs))
    assert len(warm) == 2 and report.skipped == ""
    assert report.outputs == (contract.OutputSeen("y", (-1, 4), ((1, 4, 4), (2, 4, 5))),)
    assert report.answered == (("y", (-1, 4, -1)),)


def info(**fields: Any) -> pool.InstanceInfo:
    return pool.InstanceInfo("i", "m", "1", api.Tier.FROZEN, "cpu", "/s", "n", 0, 0.0, 0.0, "h", "", api.Tier.FROZEN,
                             **fields)


def test_the_emi_conditions_say_a_skipped_warm_up_and_a_contradiction() -> None:
    assert sync.warmup_conditions(info(), [], NOW) == []  # the worker has not said yet
    mismatch = "the model's answers contradict its declared outputs: output 'y': declared [-1, 4], ..."
    found = sync.warmup_conditions(info(warmup_reported=True, warmup_skipped="the model refused ...",
                                        output_mismatch=mismatch), [], NOW)
    assert found == [
        {"type": "WarmedUp", "status": "False", "reason": "WarmupSkipped", "message": "the model refused ...",
         "lastTransitionTime": NOW},
        {"type": "OutputsMatchDeclaration", "status": "False", "reason": "OutputShapeMismatch", "message": mismatch,
         "lastTransitionTime": NOW}]
    later = sync.warmup_conditions(info(warmup_reported=True), found, "2026-12-01T00:05:00Z")
    assert [(c["type"], c["status"], c["reason"], c["lastTransitionTime"]) for c in later] == [
        ("WarmedUp", "True", "WarmedUp", "2026-12-01T00:05:00Z"),
        ("OutputsMatchDeclaration", "True", "OutputsMatch", "2026-12-01T00:05:00Z")]


def spec(model_id: str = "m") -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({
        "modelId": model_id, "framework": "onnx", "source": "/m.onnx",
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 4]}, {"name": "z", "dtype": "FP32", "shape": [1]}]})


def test_the_catalog_says_the_answered_shapes_while_the_spec_stays() -> None:
    models = catalog.Catalog({"m": spec()})
    assert [t.shape for t in models.outputs("m")] == [[-1, 4], [1]]
    models.answered("m", [("y", (-1, 4, 1)), ("nope", (3,))])
    assert [(t.name, t.shape) for t in models.outputs("m")] == [("y", [-1, 4, 1]), ("z", [1])]
    assert models.get("m").outputs[0].shape == [-1, 4]  # the ModelSpec itself is not changed
    models.replace([spec(), spec("other")])
    assert models.outputs("m")[0].shape == [-1, 4, 1]
    changed = spec().model_copy(update={"version": "2"})
    models.replace([changed])
    assert models.outputs("m")[0].shape == [-1, 4]


def test_status_shows_what_went_wrong_with_instances_that_serve() -> None:
    emi = {"metadata": {"name": "m-0"}, "spec": {"modelId": "m", "node": "n"},
           "status": {"tier": "FROZEN", "conditions": [
               {"type": "Ready", "status": "True", "reason": "Ready", "message": "wakes from FROZEN"},
               {"type": "WarmedUp", "status": "False", "reason": "WarmupSkipped", "message": "the model refused ..."},
               {"type": "OutputsMatchDeclaration", "status": "True", "reason": "OutputsMatch", "message": "fine"}]}}
    [model] = status_view.from_objects([], [emi])
    assert model.instances[0].reason == "" and model.instances[0].notices == ("WarmupSkipped: the model refused ...",)
    assert model.to_json()["instanceList"][0]["notices"] == ["WarmupSkipped: the model refused ..."]
    assert status_view.table([model]).splitlines()[-1] == "m-0 (m, FROZEN): WarmupSkipped: the model refused ..."


def tensors(*shapes: list[int]) -> list[api.TensorSpec]:
    return [api.TensorSpec(name=f"in{i}", dtype=api.DType.FP32, shape=shape) for i, shape in enumerate(shapes)]


def test_the_dynamic_dimensions_probed_share_their_symbols_and_leave_the_batch_out() -> None:
    inputs = tensors([-1, 3, -1, -1], [-1, -1], [2, -1])
    symbols = {"in0": ("batch", None, "height", "width"), "in1": ("batch", "height"), "in2": (None, "batch")}
    assert probe.dynamic_dims(inputs, symbols) == {("in0", 2): "height", ("in0", 3): "width", ("in1", 1): "height"}
    assert probe.dynamic_dims(tensors([-1, -1]), {}) == {("in0", 1): "in0[1]"}
    assert probe.dynamic_dims(tensors([-1, 3]), {}) == {}


def test_the_ladder_tries_one_size_for_all_then_mixed_sizes_smallest_first() -> None:
    one = list(probe.ladder(["t"]))
    assert [s["t"] for s in one] == list(probe.LADDER)
    two = list(probe.ladder(["h", "w"]))
    assert len(two) == probe.MAX_TRIALS and len({tuple(s.values()) for s in two}) == probe.MAX_TRIALS
    assert [tuple(s.values()) for s in two[:len(probe.LADDER)]] == [(n, n) for n in probe.LADDER]
    assert [tuple(s.values()) for s in two[len(probe.LADDER):][:4]] == [(1, 2), (2, 1), (1, 4), (4, 1)]
    many = list(itertools.islice(probe.ladder([f"d{i}" for i in range(8)]), 3))  # no product of 11^8 built
    assert [set(s.values()) for s in many] == [{1}, {2}, {4}]


def test_the_probe_finds_the_first_shapes_a_model_runs_or_says_it_found_none() -> None:
    inputs = tensors([-1, 1, -1, -1])
    symbols = {"in0": ("batch", None, "height", "width")}
    tried: list[tuple[int, ...]] = []

    def detector(feed: dict[str, np.ndarray]) -> None:
        tried.append(feed["in0"].shape)
        if min(feed["in0"].shape[2:]) < 5:
            raise ValueError("Invalid input shape")

    found = probe.probe(inputs, symbols, detector)
    assert found is not None and found.shapes == {"in0": (1, 1, 8, 8)} and found.tried == 4
    assert tried == [(1, 1, 1, 1), (1, 1, 2, 2), (1, 1, 4, 4), (1, 1, 8, 8)]
    assert found.warmup == [{"inputs": {"in0": {"shape": [1, 1, 8, 8]}}}]
    assert "smallest probed shapes it ran are in0 [1, 1, 8, 8]" in " ".join(found.comment)

    def wide_only(feed: dict[str, np.ndarray]) -> None:  # height 1, width at least 16
        if feed["in0"].shape[2] != 1 or feed["in0"].shape[3] < 16:
            raise ValueError("no")

    assert probe.probe(inputs, {}, wide_only).shapes == {"in0": (1, 1, 1, 16)}  # type: ignore[union-attr]

    def never(feed: dict[str, np.ndarray]) -> None:
        raise ValueError("Reshape: cannot reshape to [1, 7]")

    none = probe.probe(inputs, symbols, never)
    assert none is not None and none.shapes is None and none.warmup == []
    assert none.tried == probe.MAX_TRIALS and "Reshape: cannot reshape to [1, 7]" in " ".join(none.comment)
    assert probe.probe(tensors([-1, 3]), {}, never) is None  # nothing dynamic but the batch: nothing to probe


def test_the_comment_goes_above_the_runtime_section() -> None:
    found = probe.Probed({"x": (1, 8)}, "input 'x' [-1, -1]", 4)
    text = "spec:\n  modelId: m\n  pool: {frozen: 1}\n  runtime:\n    warmup: []\n"
    lines = probe.annotate(text, found).splitlines()
    at = lines.index("  runtime:")
    assert lines[2] == "  pool: {frozen: 1}" and all(line.startswith("  # ") for line in lines[3:at])
    assert all(len(line) <= probe.COMMENT_WIDTH + 4 for line in lines)
    assert probe.annotate(text, None) == text
