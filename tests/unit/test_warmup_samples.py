"""Declared warm-up without a worker: samples and an .npz file in runtime, checked against the signature with field
paths; the worker's labelled samples and the one that fails named. `volga status` without an agent. A real model
through a real `volga up`: tests/integration/test_warmup.py."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import yaml
from silero_specs import GOOD, document

from volga_agent.app import status as status_view
from volga_agent.node import signature
from volga_agent.worker import contract, warmup
from volga_core import api


def problems(doc: dict[str, Any]) -> dict[str, str]:
    """Field path -> reason, for a document whose signature is read from the model file as `volga up` does."""
    try:
        signature.fill(api.parse_model_spec(doc).spec)
    except api.SpecError as exc:
        return dict(exc.problems)
    return {}


def test_declared_samples_are_checked_against_the_signature_with_their_paths() -> None:
    bad = [GOOD[0], {"inputs": {"sr": {"shape": [1], "values": [16000]}, "nope": {"shape": [1]},
                                "state": {"shape": [2, 1, 64]}, "input": {"shape": [1, 8], "fill": 0.5}}},
           {"inputs": {"sr": {"shape": [], "values": [16000.5]}}}]
    found = problems(document("vad", {"warmup": bad}))
    assert found["spec.runtime.warmup[1].inputs.sr"] == "shape [1] has rank 1; input 'sr' has rank 0 ([])"
    assert found["spec.runtime.warmup[1].inputs.nope"].startswith("the model has no input 'nope' (it has 'input'")
    assert "dimension 2 is 64, the input fixes it at 128" in found["spec.runtime.warmup[1].inputs.state"]
    assert found["spec.runtime.warmup[2].inputs.sr"] == "input 'sr' is INT64: 16000.5 is not an integer"
    assert "spec.runtime.warmup[1].inputs.input" not in found and "spec.runtime.warmup[0]" not in str(found)
    assert problems(document("vad", {"warmup": GOOD})) == {}


@pytest.mark.parametrize(("given", "reason"), [
    ({"shape": [1, 576], "fill": 0, "range": [0, 1]}, "give one of fill, range and values, not fill and range"),
    ({"fill": 0}, "shape is required (unless values are given)"),
    ({"shape": [2, 2], "values": [1, 2, 3]}, "3 values given for shape [2, 2], which has 4 elements"),
    ({"shape": [1], "range": [1, 1]}, "range [1.0, 1.0]: low must be below high"),
    ({"shape": [65536, 65536]}, "more than 134217728"),
])
def test_a_malformed_sample_input_names_its_path(given: dict[str, Any], reason: str) -> None:
    doc = document("vad", {"warmup": [{"inputs": {"input": given}}]})
    with pytest.raises(api.SpecError) as caught:
        api.parse_model_spec(doc)
    [(path, why)] = caught.value.problems
    assert path == "spec.runtime.warmup[0].inputs.input" and reason in why


def test_a_written_signature_is_checked_when_the_spec_is_parsed() -> None:
    doc = document("m", {"warmup": [{"inputs": {"x": {"shape": [300, 3]}}}], "maxBatchSize": 256})
    doc["spec"]["inputs"] = [{"name": "x", "dtype": "BOOL", "shape": [-1, 3]}]
    doc["spec"]["outputs"] = [{"name": "y", "dtype": "FP32", "shape": [-1]}]
    with pytest.raises(api.SpecError) as caught:
        api.parse_model_spec(doc)
    assert caught.value.problems == [("spec.runtime.warmup[0].inputs.x", "batch 300 is over runtime.maxBatchSize 256")]
    doc["spec"]["runtime"]["warmup"] = [{"inputs": {"x": {"shape": [1, 3], "values": [0, 1, 2]}}}]
    with pytest.raises(api.SpecError) as caught:
        api.parse_model_spec(doc)
    assert caught.value.problems == [("spec.runtime.warmup[0].inputs.x",
                                      "input 'x' is BOOL: 2 is not a boolean (write 0 or 1)")]


def test_a_warmup_file_is_resolved_next_to_the_spec_and_checked(tmp_path: pathlib.Path) -> None:
    np.savez(tmp_path / "real.npz", input=np.zeros((1, 576), np.float64), state=np.zeros((2, 1, 128), np.float32))
    (tmp_path / "vad.yaml").write_text(yaml.safe_dump(document("vad", {"warmupFile": "real.npz"})))
    with pytest.raises(api.SpecError) as caught:
        signature.load_files([str(tmp_path / "vad.yaml")])
    [(path, reason)] = caught.value.problems
    assert path == "spec.runtime.warmupFile"
    assert reason == f"{tmp_path / 'real.npz'}: array 'input' is float64, input 'input' is FP32"
    np.savez(tmp_path / "real.npz", **{"0/input": np.zeros((1, 576), np.float32), "1/sr": np.array(8000)})
    [spec] = signature.load_files([str(tmp_path / "vad.yaml")])
    assert spec.spec.runtime.warmup_file == str(tmp_path / "real.npz")


def test_the_worker_builds_labelled_samples_and_names_a_failing_one(tmp_path: pathlib.Path) -> None:
    decls = (contract.TensorDecl("x", "FP32", (-1, 4)), contract.TensorDecl("n", "INT64", ()))
    samples = (contract.WarmupSample((contract.WarmupTensor("x", (2, 4), low=-1.0, high=1.0),)),
               contract.WarmupSample((contract.WarmupTensor("x", (1, 4), fill=7.0),
                                      contract.WarmupTensor("n", (), values=(3.0,)))))
    np.savez(tmp_path / "w.npz", x=np.ones((3, 4), np.float32), n=np.array(5))
    config = contract.WorkerConfig("m", "onnx", "/m.onnx", decls, (), "/s", "/d", warmup=samples,
                                   warmup_file=str(tmp_path / "w.npz"))
    config = contract.WorkerConfig.from_json(config.to_json())
    built = warmup.samples(config)
    assert [s.label.split(" (")[0] for s in built] == [
        "warm-up sample 0", "warm-up sample 1", f"warm-up file {tmp_path / 'w.npz'} sample 0"]
    assert built[1].label == "warm-up sample 1 (input 'x' shape [1, 4], input 'n' shape [])"
    assert np.all(built[1].inputs["x"] == 7) and built[1].inputs["n"] == 3 and built[1].inputs["n"].shape == ()
    assert np.all(np.abs(built[0].inputs["x"]) <= 1) and built[2].inputs["n"] == 5

    def refuse_one(inputs: dict[str, np.ndarray]) -> None:
        if inputs["x"].shape == (1, 4):
            raise ValueError("Pad reflect requires axis length >= 2")

    with pytest.raises(warmup.WarmupError, match=r"^warm-up sample 1 \(input 'x' shape \[1, 4\], input 'n' shape "
                                                 r"\[\]\): ValueError: Pad reflect requires axis length >= 2$"):
        warmup.run(refuse_one, built, iterations=2)


def test_status_says_when_no_agent_answers() -> None:
    with pytest.raises(status_view.SourceError, match=r"agent 127\.0\.0\.1:1: UNAVAILABLE"):
        status_view.from_agent("127.0.0.1:1", timeout=5)
