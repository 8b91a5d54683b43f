"""Requests a real model refuses, requests that name two models, and versions that do not exist: each is the
client's error with the status Triton and KServe give it, through an unmodified tritonclient (gRPC and HTTP)."""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Iterator

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from volga_agent.app import up as volga_up
from volga_bench import harness
from volga_core import api

# tritonclient.http's __del__ closes its gevent pool from whichever thread collects it, and warns.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
MODEL = "vad-conv"
KERNEL = 5  # the model's first convolution: a window shorter than this is refused by the model itself


def build_conv(path: pathlib.Path) -> pathlib.Path:
    """An audio model with a dynamic sample count whose first layer is a convolution of KERNEL samples: the
    declaration allows any window, the model refuses one shorter than its kernel (as real VAD models do)."""
    weights = numpy_helper.from_array(np.linspace(-1, 1, KERNEL, dtype=np.float32).reshape(1, 1, KERNEL), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["audio", "w"], ["score"])], "conv",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 1, "samples"])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1, "frames"])], [weights])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def up() -> Iterator[volga_up.Embedded]:
    with tempfile.TemporaryDirectory(prefix="vr-", dir="/tmp") as folder:
        root = pathlib.Path(folder)
        root.chmod(0o755)  # workers that drop to nobody reach the model
        model = build_conv(root / "model.onnx")
        spec = api.parse_model_spec({
            "apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": MODEL},
            "spec": {"modelId": MODEL, "framework": "onnx", "source": f"file://{model}", "version": "1",
                     "inputs": [{"name": "audio", "dtype": "FP32", "shape": [-1, 1, -1]}],
                     "outputs": [{"name": "score", "dtype": "FP32", "shape": [-1, 1, -1]}],
                     "pool": {"hot": 1},
                     "runtime": {"warmup": [{"inputs": {"audio": {"shape": [1, 1, 64], "range": [-1, 1]}}}]}}})
        bg, embedded = harness.start_embedded([spec])
        bg.call(embedded.wait_converged(), timeout=300)
        yield embedded
        bg.call(embedded.stop(), timeout=60)
        bg.close()


def window(samples: int, module: type = grpcclient.InferInput) -> list[object]:
    x = np.linspace(-1, 1, samples, dtype=np.float32).reshape(1, 1, samples)
    item = module("audio", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return [item]


def counted(up: volga_up.Embedded, code: str, protocol: str) -> float:
    value = up.gateway.metrics.registry.get_sample_value(
        "volga_gateway_requests_total", {"model": MODEL, "protocol": protocol, "code": code})
    return value or 0.0


def test_an_input_the_model_refuses_is_the_clients_error(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                                         h: httpclient.InferenceServerClient) -> None:
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 1, 32)
    want = np.convolve(x.ravel(), np.linspace(-1, 1, KERNEL, dtype=np.float32)[::-1], mode="valid")
    assert np.allclose(g.infer(MODEL, window(32)).as_numpy("score").ravel(), want, atol=1e-5)
    before = counted(up, "INVALID_ARGUMENT", "grpc"), counted(up, "INVALID_ARGUMENT", "http")
    with pytest.raises(InferenceServerException) as grpc_error:
        g.infer(MODEL, window(KERNEL - 2))
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "the model refused the input" in grpc_error.value.message()
    assert "Invalid input shape" in grpc_error.value.message()
    with pytest.raises(InferenceServerException) as http_error:
        h.infer(MODEL, window(KERNEL - 2, httpclient.InferInput))
    assert http_error.value.status() == "400"
    assert (counted(up, "INVALID_ARGUMENT", "grpc"), counted(up, "INVALID_ARGUMENT", "http")) == (
        before[0] + 1, before[1] + 1)
    # The worker keeps serving: a refused input is one request's error, not the instance's.
    assert np.allclose(g.infer(MODEL, window(32)).as_numpy("score").ravel(), want, atol=1e-5)


def test_x_model_id_that_contradicts_the_named_model_is_refused(g: grpcclient.InferenceServerClient,
                                                                h: httpclient.InferenceServerClient) -> None:
    same = g.infer(MODEL, window(16), headers={"x-model-id": MODEL}).as_numpy("score")
    assert np.array_equal(same, g.infer(MODEL, window(16)).as_numpy("score"))
    for call in (lambda: g.infer("other", window(16), headers={"x-model-id": MODEL}),
                 lambda: g.get_model_metadata("other", headers={"x-model-id": MODEL}),
                 lambda: g.get_model_config("other", headers={"x-model-id": MODEL})):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert f"x-model-id '{MODEL}'" in refused.value.message() and "'other'" in refused.value.message()
    for call in (lambda: h.infer("other", window(16, httpclient.InferInput), headers={"x-model-id": MODEL}),
                 lambda: h.get_model_metadata("other", headers={"x-model-id": MODEL})):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "400"
        assert "name different models" in refused.value.message()


def test_a_version_that_does_not_exist_is_not_found(g: grpcclient.InferenceServerClient,
                                                    h: httpclient.InferenceServerClient) -> None:
    answer = g.infer(MODEL, window(16)).as_numpy("score")
    assert np.array_equal(g.infer(MODEL, window(16), model_version="1").as_numpy("score"), answer)
    assert np.array_equal(h.infer(MODEL, window(16, httpclient.InferInput), model_version="1").as_numpy("score"),
                          answer)
    assert g.get_model_metadata(MODEL, model_version="1", as_json=True)["versions"] == ["1"]
    assert g.is_model_ready(MODEL, "1") and not g.is_model_ready(MODEL, "2")
    assert h.is_model_ready(MODEL, "1") and not h.is_model_ready(MODEL, "2")
    for call in (lambda: g.infer(MODEL, window(16), model_version="2"),
                 lambda: g.get_model_metadata(MODEL, model_version="2"),
                 lambda: g.get_model_config(MODEL, model_version="2")):
        with pytest.raises(InferenceServerException) as missing:
            call()
        assert missing.value.status() == "StatusCode.NOT_FOUND"
        assert "has no version '2': it serves version '1'" in missing.value.message()
    for call in (lambda: h.infer(MODEL, window(16, httpclient.InferInput), model_version="2"),
                 lambda: h.get_model_metadata(MODEL, model_version="2"),
                 lambda: h.get_model_config(MODEL, model_version="2")):
        with pytest.raises(InferenceServerException) as missing:
            call()
        assert missing.value.status() == "404"
