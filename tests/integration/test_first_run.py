"""A first run with real model files, as a user makes it: `volga inspect model.onnx > specs/m.yaml`, then
`volga up -f specs/` and `volga validate -f specs/`, an unmodified tritonclient (gRPC and HTTP) in front.

- the model file in another folder than its ModelSpec: `volga up` stops at the start (exit 2), once, naming the
  ModelSpec, the roots, `--model-root` and settings.model_roots, and `volga validate` calls the spec invalid with
  the same words; with `--model-root` both accept it and the model serves, bit-exact to onnxruntime;
- a folder with a good ModelSpec and one whose model file is garbage bytes: the good one serves, the other is
  UNAVAILABLE with the reason for every request, never ready, listed so in the repository index and in
  `volga status`;
- a model whose instance the node refuses to create (model code not allowed) is UNAVAILABLE with the reason,
  not an unknown model.
What is decided without a process: tests/unit/test_first_run_rules.py."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import procs
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from volga_agent.app import defaultmodel
from volga_bench import harness

# tritonclient.http's __del__ closes its gevent pool from whichever thread collects it, and warns.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def volga(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "volga_agent.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def build(path: pathlib.Path) -> pathlib.Path:
    """y = tanh(x @ w + b): a symbolic batch, weights that make every output bit depend on the inputs."""
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((6, 5)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
         helper.make_node("Tanh", ["z"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])], [w, b])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def inspect_into(model: pathlib.Path, spec: pathlib.Path) -> pathlib.Path:
    """`volga inspect MODEL > SPEC`, as the README says."""
    out = volga("inspect", str(model))
    assert out.returncode == 0, out.stderr
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(out.stdout)
    return spec


def expected(model: pathlib.Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def infer_both(up: harness.UpProcess, model_id: str, x: np.ndarray) -> list[np.ndarray]:
    """The model's answer through tritonclient.grpc and tritonclient.http."""
    answers = []
    for module, address in ((grpcclient, up.endpoints["grpc"]),
                            (httpclient, up.endpoints["http"].removeprefix("http://"))):
        client: Any = module.InferenceServerClient(address)
        item = module.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        answers.append(client.infer(model_id, [item]).as_numpy("y"))
        client.close()
    return answers


@pytest.fixture
def apart(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """models/m.onnx and specs/m.yaml printed by `volga inspect`: the model file outside the spec's folder."""
    (tmp_path / "models").mkdir()
    model = build(tmp_path / "models" / "m.onnx")
    inspect_into(model, tmp_path / "specs" / "m.yaml")
    return tmp_path / "specs", tmp_path / "models"


def test_model_outside_the_roots_stops_volga_up_at_the_start_and_model_root_serves_it(
        tmp_path: pathlib.Path, apart: tuple[pathlib.Path, pathlib.Path]) -> None:
    specs, models = apart
    out = volga("up", "-f", "specs/", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                "--agent-port", "-1", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "listening on" not in out.stdout and "warming" not in out.stdout  # nothing started
    assert out.stderr.startswith("volga up: 1 ModelSpec names a model file outside the model roots; nothing was "
                                 "started:\n"), out.stderr
    assert (f"  specs/m.yaml: ModelSpec m: spec.source: file://{models / 'm.onnx'}: the model file "
            f"{models / 'm.onnx'} is outside the model roots\n") in out.stderr
    assert f"  the model roots: {specs}, {defaultmodel.default_cache()} (the default: " in out.stderr
    assert "`volga up --model-root DIR` (repeatable" in out.stderr
    assert "the setting settings.model_roots" in out.stderr
    assert out.stderr.count("is outside the model roots") == 1  # once, not once per instance

    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    with harness.volga_up(["-f", str(specs), "--model-root", str(models),
                           "--snapshot-dir", str(tmp_path / "snapshots")]) as up:
        want = expected(models / "m.onnx", x)
        for got in infer_both(up, "m", x):
            assert got.dtype == want.dtype and np.array_equal(got, want)  # bit-exact


def test_validate_holds_the_spec_to_the_same_roots(tmp_path: pathlib.Path,
                                                   apart: tuple[pathlib.Path, pathlib.Path]) -> None:
    specs, models = apart
    out = volga("validate", "-f", "specs/", cwd=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "is valid" not in out.stdout
    assert (f"specs/m.yaml: ModelSpec m: invalid\n  spec.source: file://{models / 'm.onnx'}: the model file "
            f"{models / 'm.onnx'} is outside the model roots\n") in out.stderr
    assert f"the model roots: {specs}, {defaultmodel.default_cache()}" in out.stderr
    assert "`volga up --model-root DIR`" in out.stderr and "settings.model_roots" in out.stderr
    out = volga("validate", "-f", "specs/", "--model-root", "models", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "specs/m.yaml: ModelSpec m (m, onnx) is valid" in out.stdout


@pytest.fixture
def mixed(tmp_path: pathlib.Path) -> Iterator[tuple[harness.UpProcess, pathlib.Path]]:
    """`volga up -f specs/` with good.yaml (a real model) beside bad.yaml (garbage bytes for a model file)."""
    specs = tmp_path / "specs"
    specs.mkdir()
    good = build(specs / "good.onnx")
    inspect_into(good, specs / "good.yaml")
    (specs / "bad.onnx").write_bytes(np.random.default_rng(1).bytes(4096))
    document = yaml.safe_load((specs / "good.yaml").read_text())
    document["metadata"]["name"] = document["spec"]["modelId"] = "bad"
    document["spec"]["source"] = f"file://{specs / 'bad.onnx'}"
    del document["spec"]["inputs"], document["spec"]["outputs"]  # to be read from the (garbage) file
    (specs / "bad.yaml").write_text(yaml.safe_dump(document))
    # Two gateway processes on the same ports: the other one refuses the model with the same reason.
    with harness.volga_up(["-f", str(specs), "--snapshot-dir", str(tmp_path / "snapshots"),
                           "--gateway-processes", "2"]) as up:
        yield up, specs


def test_a_model_file_that_does_not_parse_refuses_that_model_only(
        mixed: tuple[harness.UpProcess, pathlib.Path]) -> None:
    up, specs = mixed
    printed = "".join(up.output)
    assert (f"volga up: {specs / 'bad.yaml'}: ModelSpec bad (model 'bad') cannot be served:\n  spec.source: "
            f"{specs / 'bad.onnx'} is not an ONNX model: ") in printed
    assert "volga up: serving the other 1 ModelSpec(s); requests for 'bad' answer UNAVAILABLE" in printed
    assert up.endpoints["models"] == "good"
    refused = "  refused  bad (not served: requests for them answer UNAVAILABLE with the reason)"
    procs.wait_for("the refused models' line", lambda: refused in "".join(up.output), timeout=10)

    x = np.random.default_rng(5).standard_normal((3, 6)).astype(np.float32)
    want = expected(specs / "good.onnx", x)
    for got in infer_both(up, "good", x):
        assert np.array_equal(got, want)

    reason = f"could not be loaded when volga up started: spec.source: {specs / 'bad.onnx'} is not an ONNX model"
    grpc = grpcclient.InferenceServerClient(up.endpoints["grpc"])
    http = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"))
    try:
        for client, code, module in ((grpc, "StatusCode.UNAVAILABLE", grpcclient), (http, "503", httpclient)):
            item = module.InferInput("x", [1, 6], "FP32")
            item.set_data_from_numpy(x[:1])
            calls = [lambda c=client, i=item: c.infer("bad", [i]), lambda c=client: c.get_model_metadata("bad"),
                     lambda c=client: c.get_model_config("bad")]
            for call in calls:
                with pytest.raises(InferenceServerException) as caught:
                    call()
                assert str(caught.value.status()) == code, caught.value
                assert "model 'bad' is unavailable: its ModelSpec bad" in str(caught.value.message())
                assert reason in str(caught.value.message()), caught.value.message()
            assert not client.is_model_ready("bad") and client.is_model_ready("good")
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["bad"]["state"] == "UNAVAILABLE" and reason in index["bad"]["reason"], index
        assert index["good"]["state"] == "READY", index
        [entry] = [m for m in grpc.get_model_repository_index(as_json=True)["models"] if m["name"] == "bad"]
        assert entry["state"] == "UNAVAILABLE" and reason in entry["reason"]
    finally:
        grpc.close()
        http.close()

    status = volga("status", "--agent", up.endpoints["agent"])
    assert status.returncode == 0, status.stderr
    assert f"bad-0 (bad, COLD): cannot create the instance: its ModelSpec bad ({specs / 'bad.yaml'}) {reason}" \
        in status.stdout
    listed = volga("status", "--agent", up.endpoints["agent"], "--json")
    assert listed.returncode == 0, listed.stderr
    assert {"bad", "good"} <= {m["modelId"] for m in yaml.safe_load(listed.stdout)["models"]}


def test_nothing_left_to_serve_exits_2(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.onnx").write_bytes(b"\x00not a model" * 100)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec", "metadata": {"name": "bad"},
         "spec": {"modelId": "bad", "framework": "onnx", "source": str(tmp_path / "bad.onnx")}}))
    out = volga("up", "-f", str(tmp_path), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                "--agent-port", "-1")
    assert out.returncode == 2
    assert f"volga up: {tmp_path / 'bad.yaml'}: ModelSpec bad (model 'bad') cannot be served:" in out.stderr
    assert out.stderr.rstrip().endswith("volga up: no ModelSpec is left to serve")


def test_a_model_whose_instance_the_node_refuses_is_unavailable_with_the_reason(tmp_path: pathlib.Path) -> None:
    """The node refuses to create the instance (pytorch runs model code; not allowed): the model's requests are
    UNAVAILABLE naming why, not NOT_FOUND 'no instance of model'."""
    specs = tmp_path / "specs"
    specs.mkdir()
    good = build(specs / "good.onnx")
    inspect_into(good, specs / "good.yaml")
    (specs / "code.pt").write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    document = yaml.safe_load((specs / "good.yaml").read_text())
    document["metadata"]["name"] = document["spec"]["modelId"] = "code"
    document["spec"].update({"framework": "pytorch", "source": str(specs / "code.pt")})
    (specs / "code.yaml").write_text(yaml.safe_dump(document))
    with harness.volga_up(["-f", str(specs), "--snapshot-dir", str(tmp_path / "snapshots")]) as up:
        assert "  models   code, good (1 instance warming into its tier; 1 could not be created: requests for " \
            "their models answer UNAVAILABLE with the reason" in "".join(up.output)
        x = np.zeros((1, 6), np.float32)
        for module, address, code in ((grpcclient, up.endpoints["grpc"], "StatusCode.UNAVAILABLE"),
                                      (httpclient, up.endpoints["http"].removeprefix("http://"), "503")):
            client: Any = module.InferenceServerClient(address)
            item = module.InferInput("x", [1, 6], "FP32")
            item.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("code", [item])
            assert str(caught.value.status()) == code, caught.value
            message = str(caught.value.message())
            assert message.startswith("could not wake model 'code': no instance of model 'code' could be created "
                                      "on node "), message
            assert "this node does not allow model code" in message
            assert not client.is_model_ready("code")
            client.close()
