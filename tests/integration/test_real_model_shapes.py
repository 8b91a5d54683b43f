"""Two things real models do, through real workers and an unmodified tritonclient, with ONNX files built here:

- a detector with dynamic height and width (a 5-wide convolution) refuses the made-up warm-up (those dimensions as
  1): it serves anyway, its answers bit-exact to onnxruntime's, and the skipped warm-up shows in the instance's
  state (Agent API, `volga status`), its EMI condition, a metric and the logs; `volga inspect` probes a warm-up
  sample it runs, and the spec it prints warms up;
- a model whose answers contradict its declared output shape (the file says rank 2, the model answers rank 3) is
  reported the same ways and by `volga validate --run`, and the gateway's metadata and configuration say what it
  answers, through the in-process link and through the Agent API.

The pure parts (shapes, conditions, the probe's ladder): tests/unit/test_warmup_findings.py."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto, helper, numpy_helper
from procs import series

from volga_agent.app import status as status_view
from volga_agent.app import up as volga_up
from volga_agent.cluster import sync
from volga_agent.gateway import app, catalog, links
from volga_agent.node import signature
from volga_agent.worker import contract
from volga_bench import harness
from volga_core import api

OPSET = [helper.make_opsetid("", 17)]


def detector(path: pathlib.Path) -> pathlib.Path:
    """image [batch, 1, height, width] -> features [batch, 2, h, w]: a 5x5 convolution, so fewer than 5 rows or
    columns is refused."""
    weights = np.random.default_rng(7).standard_normal((2, 1, 5, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "w"], ["features"])], "detector",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, "height", "width"])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 2, "h", "w"])],
        [numpy_helper.from_array(weights, "w")])
    onnx.save(helper.make_model(graph, opset_imports=OPSET), path)
    return path


def contradicting(path: pathlib.Path) -> pathlib.Path:
    """x [batch, 4] -> y, declared [batch, 4] (rank 2) while Unsqueeze answers [batch, 4, 1] (rank 3): onnxruntime
    runs it, with a warning."""
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["x", "axes"], ["y"])], "contradicting",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([2], np.int64), "axes")])
    onnx.save(helper.make_model(graph, opset_imports=OPSET), path)
    return path


def seven(path: pathlib.Path) -> pathlib.Path:
    """x [batch, n] -> a reshape to [1, 7]: only n = 7 runs, no size of the probe's ladder."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "seven",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 7])],
        [numpy_helper.from_array(np.array([1, 7], np.int64), "shape")])
    onnx.save(helper.make_model(graph, opset_imports=OPSET), path)
    return path


def volga(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "volga_agent.cli", *args], capture_output=True, text=True,
                          timeout=300)


def inspected(model: pathlib.Path) -> tuple[str, dict[str, Any]]:
    out = volga("inspect", str(model))
    assert out.returncode == 0, out.stderr
    return out.stdout, yaml.safe_load(out.stdout)


def named(document: dict[str, Any], name: str, runtime: bool = True) -> api.ModelSpec:
    """`document` (as `volga inspect` printed it) under another name, without its runtime section unless `runtime`,
    its signature as the agent fills it."""
    body = {k: v for k, v in document["spec"].items() if runtime or k != "runtime"}
    parsed = api.parse_model_spec({**document, "metadata": {"name": name}, "spec": {**body, "modelId": name}})
    return parsed.model_copy(update={"spec": signature.fill(parsed.spec)})


def test_inspect_probes_a_warm_up_and_validate_run_reports(tmp_path: pathlib.Path) -> None:
    text, document = inspected(detector(tmp_path / "detector.onnx"))
    assert document["spec"]["inputs"] == [{"name": "image", "dtype": "FP32", "shape": [-1, 1, -1, -1]}]
    assert document["spec"]["runtime"] == {"warmup": [{"inputs": {"image": {"shape": [1, 1, 8, 8]}}}]}
    comment = " ".join(line.strip().removeprefix("# ") for line in text.splitlines() if line.strip().startswith("#"))
    assert "runtime.warmup was probed by `volga inspect`" in comment and "Write the sizes your clients send" in comment
    printed = tmp_path / "detector.yaml"
    printed.write_text(text)
    ran = volga("validate", "--run", "-f", str(printed))
    assert ran.returncode == 0, ran.stderr
    assert "ModelSpec detector: ran its warm-up; the answers have the declared output shapes" in ran.stdout

    # The same model without the probed sample: valid, and the run says the made-up warm-up was skipped.
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(named(document, "bare", runtime=False).to_wire()))
    bare = volga("validate", "--run", "-f", str(tmp_path / "bare.yaml"))
    assert bare.returncode == 0, bare.stderr
    assert "ModelSpec bare: warning: warm-up skipped: the model refused the made-up warm-up inputs" in bare.stderr
    assert "input 'image' shape [1, 1, 1, 1]" in bare.stderr

    # A declared sample the model refuses: the model would not start.
    refused = named(document, "refused").to_wire()
    refused["spec"]["runtime"] = {"warmup": [{"inputs": {"image": {"shape": [1, 1, 3, 3]}}}]}
    (tmp_path / "refused.yaml").write_text(yaml.safe_dump(refused))
    failed = volga("validate", "--run", "-f", str(tmp_path / "refused.yaml"))
    assert failed.returncode == 1
    assert ("ModelSpec refused: the run failed: WarmupError: warm-up sample 0 (input 'image' shape [1, 1, 3, 3]): "
            in failed.stderr)

    text, document = inspected(contradicting(tmp_path / "contra.onnx"))
    assert "runtime" not in document["spec"] and "#" not in text  # nothing dynamic but the batch
    assert document["spec"]["outputs"] == [{"name": "y", "dtype": "FP32", "shape": [-1, 4]}]
    (tmp_path / "contra.yaml").write_text(text)
    assert volga("validate", "-f", str(tmp_path / "contra.yaml")).returncode == 0  # the file agrees with itself
    ran = volga("validate", "--run", "-f", str(tmp_path / "contra.yaml"))
    assert ran.returncode == 0, ran.stderr
    assert ("ModelSpec contra: warning: the model's answers contradict its declared outputs: output 'y': declared "
            "[-1, 4], the model answered [1, 4, 1]") in ran.stderr
    assert volga("validate", "--run", "--schema-only", "-f", str(tmp_path / "contra.yaml")).returncode == 2

    text, document = inspected(seven(tmp_path / "seven.onnx"))
    assert "runtime" not in document["spec"]
    comment = " ".join(line.strip().removeprefix("# ") for line in text.splitlines() if line.strip().startswith("#"))
    assert comment.startswith("No runtime.warmup: the model's non-batch dimensions are dynamic (input 'x' [-1, -1])")
    assert "it ran none" in comment and "Reshape" in comment
    (tmp_path / "seven.yaml").write_text(text)
    assert volga("validate", "-f", str(tmp_path / "seven.yaml")).returncode == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Background, volga_up.Embedded]]:
    """`volga up`'s parts in this process: the detector without a warm-up, the spec `volga inspect` printed for it
    (a probed warm-up sample), and the contradicting model."""
    root = tmp_path_factory.mktemp("shapes")
    _, found = inspected(detector(root / "detector.onnx"))
    _, contra = inspected(contradicting(root / "contra.onnx"))
    specs = [named(found, "detector", runtime=False), named(found, "probed"), named(contra, "contra")]
    bg, embedded = harness.start_embedded(specs, tick_sec=3600.0)  # only requests move instances
    try:
        bg.call(embedded.wait_converged(240))
        yield bg, embedded
    finally:
        bg.call(embedded.stop())
        bg.close()


def infos(embedded: volga_up.Embedded) -> dict[str, Any]:
    return {i.model_id: i for i in embedded.pool.instances()}


def test_a_model_that_refuses_the_made_up_warm_up_serves_and_says_so(
        served: tuple[harness.Background, volga_up.Embedded]) -> None:
    _, embedded = served
    assert infos(embedded)["detector"].state_reason == ""  # it started: FROZEN (HOT where CRIU is missing)

    client = grpcclient.InferenceServerClient(embedded.endpoints()["grpc"])
    session = ort.InferenceSession(str(embedded.specs["detector"].source_path), providers=["CPUExecutionProvider"])
    decls = (contract.TensorDecl("image", "FP32", (-1, 1, -1, -1)),)
    try:
        for shape in ((1, 1, 16, 16), (2, 1, 9, 13)):
            image = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
            answer = client.infer("detector", harness.triton_inputs(decls, {"image": image})).as_numpy("features")
            np.testing.assert_array_equal(answer, session.run(None, {"image": image})[0])
        assert client.is_model_ready("detector")
    finally:
        client.close()
    now = infos(embedded)
    assert now["detector"].warmup_skipped.startswith("the model refused the made-up warm-up inputs")

    # The instance's state (Agent API, `volga status`), its EMI conditions, the metric, the worker's log.
    [listed] = [m for m in status_view.from_agent(embedded.endpoints()["agent"]) if m.model_id == "detector"]
    [notice] = listed.instances[0].notices
    assert notice.startswith("warm-up skipped: the model refused the made-up warm-up inputs, so it serves without a "
                             "warm-up (warm-up with made-up inputs (declare runtime.warmup to give real ones; input "
                             "'image' shape [1, 1, 1, 1]): ")
    assert "declare runtime.warmup with the input sizes your clients send" in notice
    conditions = {c["type"]: c for c in sync.warmup_conditions(infos(embedded)["detector"], [], "t")}
    assert conditions["WarmedUp"]["status"] == "False" and conditions["WarmedUp"]["reason"] == "WarmupSkipped"
    assert conditions["WarmedUp"]["message"] == now["detector"].warmup_skipped
    assert conditions["OutputsMatchDeclaration"]["status"] == "True"
    skipped = series(embedded.endpoints()["metrics"], "volga_warmup_skipped_total")
    assert skipped == {'{model="detector"}': 1.0}
    [log] = (embedded.folders["workdir"]).glob("detector-*/worker.log")
    assert "warm-up: the model refused the made-up warm-up inputs" in log.read_text()

    # The spec `volga inspect` printed warms up with its probed sample.
    embedded.pool.activate("probed")
    probed = infos(embedded)["probed"]
    assert probed.state_reason == "" and probed.warmup_reported and probed.warmup_skipped == ""
    assert {c["type"]: c["status"] for c in sync.warmup_conditions(probed, [], "t")} == {
        "WarmedUp": "True", "OutputsMatchDeclaration": "True"}
    [listed] = [m for m in status_view.from_agent(embedded.endpoints()["agent"]) if m.model_id == "probed"]
    assert listed.instances[0].notices == ()


def test_a_model_that_contradicts_its_outputs_is_reported_and_its_metadata_says_what_it_answers(
        served: tuple[harness.Background, volga_up.Embedded]) -> None:
    bg, embedded = served
    embedded.pool.activate("contra")
    contra = infos(embedded)["contra"]
    mismatch = ("the model's answers contradict its declared outputs: output 'y': declared [-1, 4], the model "
                "answered [1, 4, 1]")
    assert contra.output_mismatch == mismatch and contra.answered_outputs == (("y", (-1, 4, 1)),)
    condition = {c["type"]: c for c in sync.warmup_conditions(contra, [], "t")}["OutputsMatchDeclaration"]
    assert (condition["status"], condition["reason"], condition["message"]) == ("False", "OutputShapeMismatch",
                                                                                mismatch)
    [listed] = [m for m in status_view.from_agent(embedded.endpoints()["agent"]) if m.model_id == "contra"]
    assert listed.instances[0].notices == (mismatch,)
    assert series(embedded.endpoints()["metrics"], "volga_output_shape_mismatches_total") == {'{model="contra"}': 1.0}

    async def sidecar() -> app.Gateway:  # a gateway that asks the agent over the Agent API, as in a cluster
        gw = app.Gateway(catalog.Catalog(embedded.specs), links.GrpcAgentLink(embedded.endpoints()["agent"]),
                         app.Settings(http_port=0, grpc_port=0, metrics_port=0))
        await gw.start()
        return gw

    other = bg.call(sidecar())
    try:
        for http, grpc in ((embedded.endpoints()["http"].removeprefix("http://"), embedded.endpoints()["grpc"]),
                           (f"127.0.0.1:{other.ports['http']}", f"127.0.0.1:{other.ports['grpc']}")):
            h, g = httpclient.InferenceServerClient(http), grpcclient.InferenceServerClient(grpc)
            try:
                assert h.get_model_metadata("contra")["outputs"] == [
                    {"name": "y", "datatype": "FP32", "shape": [-1, 4, 1]}]
                assert [list(o.shape) for o in g.get_model_metadata("contra").outputs] == [[-1, 4, 1]]
                config = h.get_model_config("contra")
                assert config["max_batch_size"] > 0 and [o["dims"] for o in config["output"]] == [[4, 1]]
                assert [list(o.dims) for o in g.get_model_config("contra").config.output] == [[4, 1]]
                # The inputs keep their declaration; the answers have the shape the metadata says.
                assert h.get_model_metadata("contra")["inputs"][0]["shape"] == [-1, 4]
                x = np.arange(8, dtype=np.float32).reshape(2, 4)
                decls = (contract.TensorDecl("x", "FP32", (-1, 4)),)
                y = g.infer("contra", harness.triton_inputs(decls, {"x": x})).as_numpy("y")
                assert y.shape == (2, 4, 1) and np.array_equal(y[..., 0], x)
            finally:
                h.close()
                g.close()
    finally:
        bg.call(other.stop())


def test_the_agent_logs_what_the_warm_up_found(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cold start's findings in the agent's log (the in-process `volga up`'s pool, its own instance here)."""
    from volga_agent.node import instance

    _, found = inspected(detector(tmp_path / "detector.onnx"))
    _, contra = inspected(contradicting(tmp_path / "contra.onnx"))
    caplog.set_level(logging.WARNING, logger="volga_agent.node.instance")
    for spec in (named(found, "detector", runtime=False), named(contra, "contra")):
        inst = instance.Instance(f"{spec.metadata.name}-0", spec.spec, tmp_path / spec.metadata.name, None)
        try:
            inst.to(api.Tier.HOT)
            assert inst.warmup is not None
        finally:
            inst.close()
    assert "detector-0: warm-up skipped: the model refused the made-up warm-up inputs" in caplog.text
    assert ("contra-0: the model's answers contradict its declared outputs: output 'y': declared [-1, 4], the model "
            "answered [1, 4, 1] (the gateway's metadata says the answered shapes)") in caplog.text
