"""`volga inspect` and `volga validate` as a user runs them, on real ONNX files: the signature read from the file,
each mismatch named by its field path, and a ModelSpec that leaves its signature out served by `volga up`."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto, helper, numpy_helper

from volga_agent.app import defaultmodel
from volga_agent.node import instance
from volga_agent.worker import contract
from volga_bench import harness


def volga(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "volga_agent.cli", *args], capture_output=True, text=True,
                          timeout=120)


def build(path: pathlib.Path, inputs: list[Any] | None = None) -> pathlib.Path:
    """y = x @ w, and ids passed through: x has a symbolic batch dimension, ids a fixed shape, and the weight w
    is listed among the graph's inputs too (as older exporters do): it is not an input to serve."""
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Identity", ["ids"], ["ids_out"])], "g",
        inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                   helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4]),
                   helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("ids_out", TensorProto.INT64, [2, 4])],
        [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def spec(path: pathlib.Path, name: str = "small", **fields: Any) -> dict[str, Any]:
    body = {"modelId": name, "framework": "onnx", "source": str(path),
            "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 3]},
                       {"name": "ids", "dtype": "INT64", "shape": [2, 4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 3]}]}
    body.update(fields)
    return {"apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec", "metadata": {"name": name}, "spec": body}


def write(path: pathlib.Path, *documents: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


@pytest.fixture
def model(tmp_path: pathlib.Path) -> pathlib.Path:
    return build(tmp_path / "Small_Model.v2.onnx")


def test_inspect_prints_a_spec_validate_accepts(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    out = volga("inspect", str(model))
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert doc["metadata"]["name"] == doc["spec"]["modelId"] == "small-model-v2"
    assert doc["spec"]["framework"] == "onnx" and doc["spec"]["source"] == f"file://{model.resolve()}"
    assert doc["spec"]["inputs"] == [{"name": "x", "dtype": "FP32", "shape": [-1, 3]},
                                     {"name": "ids", "dtype": "INT64", "shape": [2, 4]}]  # no weight 'w'
    assert doc["spec"]["outputs"] == [{"name": "y", "dtype": "FP32", "shape": [-1, 3]},
                                      {"name": "ids_out", "dtype": "INT64", "shape": [2, 4]}]
    assert doc["spec"]["pool"] == {"frozen": 1}
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.stdout)
    checked = volga("validate", "-f", str(printed))
    assert checked.returncode == 0, checked.stderr
    assert "small-model-v2 (small-model-v2, onnx) is valid; input hash" in checked.stdout


def test_inspect_the_embedded_default_model(tmp_path: pathlib.Path) -> None:
    default = defaultmodel.ensure()
    out = volga("inspect", str(default.spec.source_path))
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    assert doc["spec"]["inputs"] == [t.to_wire() for t in default.spec.inputs]
    assert doc["spec"]["outputs"] == [t.to_wire() for t in default.spec.outputs]
    # The hand-written default spec agrees with its file too.
    written = write(tmp_path / "default.yaml", defaultmodel.spec_document(default.spec.source_path))
    assert volga("validate", "-f", written).returncode == 0


def test_validate_names_each_mismatch_with_the_model(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    doc = spec(model)
    doc["spec"]["inputs"][0]["name"] = "image"
    doc["spec"]["inputs"][1]["dtype"] = "FP32"
    doc["spec"]["outputs"][0]["shape"] = [-1, 3, 1]
    out = volga("validate", "-f", write(tmp_path / "bad.yaml", doc))
    assert out.returncode == 1
    assert "spec.inputs[0].name: the model has no input 'image' (it has 'x', 'ids')" in out.stderr
    assert "spec.inputs[1].dtype: the model declares INT64, the spec FP32" in out.stderr
    assert "spec.outputs[0].shape: rank 2 in the model, 3 here" in out.stderr
    assert "spec.inputs: the model's input 'x' (FP32, shape [-1, 3]) is missing here" in out.stderr
    # --schema-only does not open the model.
    assert volga("validate", "--schema-only", "-f", str(tmp_path / "bad.yaml")).returncode == 0


def test_validate_dims_symbolic_and_fixed(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    doc = spec(model)
    doc["spec"]["inputs"][0]["shape"] = [16, 3]  # the model's batch dimension is symbolic: any size matches
    doc["spec"]["inputs"][1]["shape"] = [-1, 4]  # -1 for a fixed dimension is fine
    assert volga("validate", "-f", write(tmp_path / "ok.yaml", doc)).returncode == 0
    doc["spec"]["inputs"][1]["shape"] = [3, 4]
    out = volga("validate", "-f", write(tmp_path / "fixed.yaml", doc))
    assert out.returncode == 1
    assert "spec.inputs[1].shape[0]: the model fixes this dimension at 2, the spec 3" in out.stderr


def test_validate_says_what_a_symbolic_dimension_is_written_as(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    doc = spec(model)
    doc["spec"]["inputs"][0]["shape"] = [None, 3]
    out = volga("validate", "-f", write(tmp_path / "null.yaml", doc))
    assert out.returncode == 1
    assert "spec.inputs[0].shape[0]: null is not a size: write -1 for a dimension of any size" in out.stderr


def test_validate_fills_a_left_out_signature(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    doc = spec(model)
    written = volga("validate", "-f", write(tmp_path / "written.yaml", doc))
    del doc["spec"]["inputs"], doc["spec"]["outputs"]
    path = write(tmp_path / "left-out.yaml", doc)
    out = volga("validate", "-f", path)
    assert out.returncode == 0, out.stderr
    assert "input hash" in out.stdout
    # The same inputs as written by hand: the same input hash.
    assert written.stdout.split("input hash ")[1] == out.stdout.split("input hash ")[1]
    schema_only = volga("validate", "--schema-only", "-f", path)
    assert schema_only.returncode == 0 and "to be read from the model file" in schema_only.stdout
    model.write_bytes(b"not a model")
    broken = volga("validate", "-f", path)
    assert broken.returncode == 1 and "spec.source:" in broken.stderr and "is not an ONNX model" in broken.stderr


def test_a_model_signature_a_spec_cannot_say(tmp_path: pathlib.Path) -> None:
    model = build(tmp_path / "strings.onnx", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                                              helper.make_tensor_value_info("ids", TensorProto.STRING, [2, 4])])
    out = volga("inspect", str(model))
    assert out.returncode == 1
    assert "spec.inputs: the model's input 'ids' is STRING, which has no dtype Volga serves" in out.stderr


def test_repeated_names_across_files_name_both(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    a = write(tmp_path / "a.yaml", spec(model, "one"))
    b = write(tmp_path / "b.yaml", spec(model, "one"))
    out = volga("validate", "-f", a, "-f", b)
    assert out.returncode == 1
    assert f"{b}: invalid ModelSpec" in out.stderr
    assert f"metadata.name: 'one' is already used by the ModelSpec in {a}" in out.stderr
    assert f"spec.modelId: 'one' is already used by the ModelSpec in {a}" in out.stderr
    other = spec(model, "two")
    other["spec"]["modelId"] = "one"
    c = write(tmp_path / "c.yaml", other)
    up = volga("up", "-f", a, "-f", c, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
               "--agent-port", "-1")
    assert up.returncode == 2
    assert f"{c}: invalid ModelSpec" in up.stderr and f"spec.modelId: 'one' is already used by the ModelSpec in {a}" \
        in up.stderr


def test_bad_names_and_caps_named_by_field(tmp_path: pathlib.Path, model: pathlib.Path) -> None:
    doc = spec(model)
    doc["metadata"]["name"] = "../.."
    doc["spec"]["modelId"] = "/etc/passwd"
    doc["spec"]["inputs"][0]["shape"] = [-1, 10**12]
    doc["spec"]["inputs"][1]["shape"] = [True, 4]
    doc["spec"]["outputs"][0]["name"] = "y\u202e"
    doc["spec"]["pool"] = {"hot": 1000}
    out = volga("validate", "--schema-only", "-f", write(tmp_path / "bad.yaml", doc))
    assert out.returncode == 1
    for path in ("metadata.name: must be", "spec.modelId: must be", "spec.inputs[0].shape: dimension 1000000000000",
                 "spec.inputs[1].shape[0]: true is a boolean", "spec.outputs[0].name: must not contain",
                 "spec.pool.hot: 1000 is more than 64"):
        assert path in out.stderr


def test_torchscript_files_carry_no_signature(tmp_path: pathlib.Path) -> None:
    archive = tmp_path / "model.pt"
    archive.write_bytes(b"PK\x03\x04" + b"\x00" * 60)  # TorchScript files are zip archives
    out = volga("inspect", str(archive))
    assert out.returncode == 1 and "carries no tensor signature" in out.stderr
    doc = {"apiVersion": "volga.dev/v1alpha1", "kind": "ModelSpec", "metadata": {"name": "ts"},
           "spec": {"modelId": "ts", "framework": "torchscript", "source": str(archive)}}
    out = volga("validate", "-f", write(tmp_path / "ts.yaml", doc))
    assert out.returncode == 1
    assert "spec.inputs: a torchscript file carries no tensor signature" in out.stderr


@pytest.mark.slow
def test_up_serves_a_spec_that_leaves_its_signature_out(tmp_path: pathlib.Path) -> None:
    default = defaultmodel.ensure().spec
    doc = defaultmodel.spec_document(default.source_path)
    del doc["spec"]["inputs"], doc["spec"]["outputs"]
    path = write(tmp_path / "left-out.yaml", doc)
    with harness.volga_up(["-f", path, "--snapshot-dir", str(tmp_path / "snapshots")]) as up:
        client = httpclient.InferenceServerClient(up.endpoints["http"].removeprefix("http://"))
        meta = client.get_model_metadata(default.model_id)
        assert [i["name"] for i in meta["inputs"]] == ["dense", "sparse"]
        assert [i["shape"] for i in meta["inputs"]] == [[-1, 13], [-1, 26]]
        decls = instance.decls(default.inputs)
        x = contract.sample_inputs(decls, batch=2, seed=4)
        out = client.infer(default.model_id, harness.triton_inputs(decls, x, httpclient)).as_numpy("probability")
        assert out.shape == (2, 1) and np.all((out > 0) & (out < 1))
        client.close()


def test_inspect_infers_output_shapes_the_file_leaves_out(tmp_path: pathlib.Path) -> None:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    out = volga("inspect", str(model))
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["spec"]["outputs"] == [{"name": "y", "dtype": "FP32", "shape": [-1, 3]}]
