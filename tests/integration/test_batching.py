"""Dynamic batching and load shedding in the gateway, with real workers and an unmodified tritonclient.

Two batched models run HOT beside each other: a copy of the default model (preferred batch size 4) and a small
ONNX model built here whose second input dimension is free, so that requests of different shapes exist. Both
wait up to 10 s for a batch to fill: every batch in these tests leaves the queue because it reached its size
(or a cap set at run time), never because time ran out, so what is counted does not depend on the machine's
speed. Answers are compared with onnxruntime run here on each client's own input.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from traffic import assert_retry_hints, infer_inputs
from tritonclient.utils import InferenceServerException

from volga_agent import errors
from volga_agent.app import defaultmodel
from volga_agent.app import up as volga_up
from volga_agent.worker import contract
from volga_bench import harness
from volga_core import api

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
CTR, TOY = "ctr-batched", "toy-batched"
DELAY_US = 10_000_000  # the most a spec allows
TABLE = 128  # rows of the toy model's lookup table: an index past it makes onnxruntime fail the whole call


def build_toy(path: pathlib.Path) -> pathlib.Path:
    """y = 2x with x of any [rows, width]; g = table[idx] with idx [rows, 1]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(TABLE, dtype=np.float32) / 8, "table")
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Gather", ["table", "idx"], ["g"])], "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "width"]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, ["rows", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "width"]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, ["rows", 1])], [table, two])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def batched(doc: dict[str, Any], model: str, batching: dict[str, Any]) -> api.ModelSpec:
    doc["metadata"]["name"] = doc["spec"]["modelId"] = model
    doc["spec"]["pool"] = {"hot": 1, "frozen": 0}
    doc["spec"].setdefault("runtime", {})["dynamicBatching"] = {"enabled": True, **batching}
    return api.parse_model_spec(doc)


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build_toy(tmp_path_factory.mktemp("toy") / "toy.onnx")


@pytest.fixture(scope="module")
def up(toy_path: pathlib.Path) -> Iterator[volga_up.Embedded]:
    default = defaultmodel.ensure()
    ctr = batched(defaultmodel.spec_document(default.spec.source_path), CTR,
                  {"preferredBatchSizes": [4], "maxQueueDelayMicroseconds": DELAY_US, "maxQueueSize": 16})
    toy_doc: dict[str, Any] = {"apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": TOY},
                               "spec": {"modelId": TOY, "framework": "onnx", "source": str(toy_path),
                                        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, -1]},
                                                   {"name": "idx", "dtype": "INT64", "shape": [-1, 1]}],
                                        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, -1]},
                                                    {"name": "g", "dtype": "FP32", "shape": [-1, 1]}]}}
    toy = batched(toy_doc, TOY, {"maxQueueDelayMicroseconds": DELAY_US, "maxQueueSize": 4})
    bg, embedded = harness.start_embedded([default, ctr, toy])
    bg.call(embedded.wait_converged(), timeout=300)
    yield embedded
    bg.call(embedded.stop(), timeout=60)
    bg.close()


def session(path: pathlib.Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ctr_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    spec = defaultmodel.ensure().spec
    decls = tuple(contract.TensorDecl(t.name, t.dtype.value, tuple(t.shape)) for t in spec.inputs)
    return contract.sample_inputs(decls, batch=rows, seed=seed)


def toy_inputs(rows: int, width: int, seed: int, bad: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, TABLE, size=(rows, 1))
    if bad:
        idx[0, 0] = 10 * TABLE
    return {"x": rng.standard_normal((rows, width)).astype(np.float32), "idx": idx.astype(np.int64)}


Result = dict[str, np.ndarray] | InferenceServerException


def fire(up: volga_up.Embedded, g: grpcclient.InferenceServerClient, model: str,
         requests: list[tuple[str, dict[str, np.ndarray]]], outputs: tuple[str, ...],
         headers: dict[str, str] | None = None) -> list[Callable[[], Result]]:
    """Send each (protocol, inputs) without waiting for the answers; one `result()` per request. gRPC requests
    go out on `g` (async_infer); each REST request on its own client in its own thread (tritonclient.http's
    async_infer sends nothing until the calling thread yields to gevent)."""
    results: list[Callable[[], Result]] = []
    for proto, x in requests:
        box: list[Result] = []
        done = threading.Event()

        def keep(result: Any, error: Any, box: list[Result] = box, done: threading.Event = done) -> None:
            box.append(error if error is not None else {n: result.as_numpy(n) for n in outputs})
            done.set()

        if proto == "grpc":
            g.async_infer(model, infer_inputs(x, grpcclient), keep, headers=headers)
        else:
            def send(x: dict[str, np.ndarray] = x, keep: Callable[[Any, Any], None] = keep) -> None:
                client = httpclient.InferenceServerClient(up.endpoints()["http"].removeprefix("http://"))
                try:
                    keep(client.infer(model, infer_inputs(x, httpclient), headers=headers), None)
                except InferenceServerException as exc:
                    keep(None, exc)
                finally:
                    client.close()

            threading.Thread(target=send, daemon=True).start()

        def result(box: list[Result] = box, done: threading.Event = done) -> Result:
            assert done.wait(120)
            return box[0]

        results.append(result)
    return results


def batches(up: volga_up.Embedded, model: str) -> tuple[float, float, float]:
    """(worker calls, rows, requests) the batcher has sent for the model so far."""
    registry = up.gateway.metrics.registry

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model": model}) or 0.0

    return (value("volga_gateway_batch_size_count"), value("volga_gateway_batch_size_sum"),
            value("volga_gateway_batch_requests_sum"))


def since(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


def wait_queued(up: volga_up.Embedded, model: str, count: int) -> None:
    """Until `count` requests of the model wait in its batch queue (they stay: their batch cannot fill)."""
    plane = up.gateway.dataplane
    for _ in range(12_000):  # a bound for a broken gateway, not a speed expectation
        if model in plane.batchers and plane.batchers[model].depth() >= count:
            return
        time.sleep(0.01)
    pytest.fail(f"{count} requests of {model} never queued")


def test_requests_are_batched_and_each_client_gets_its_own_rows(
        up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    ort_ctr = session(defaultmodel.ensure().spec.source_path)
    inputs = [ctr_inputs(1, 1), ctr_inputs(2, 2), ctr_inputs(1, 3)]  # 4 rows: the preferred batch size
    before = batches(up, CTR)
    results = [r() for r in fire(up, g, CTR, [("grpc", inputs[0]), ("http", inputs[1]), ("grpc", inputs[2])],
                                 ("probability",))]
    assert since(before, batches(up, CTR)) == (1, 4, 3)  # one worker call of 4 rows carried the 3 requests
    for x, got in zip(inputs, results, strict=True):
        assert isinstance(got, dict), got
        assert np.array_equal(got["probability"], ort_ctr.run(None, x)[0])


def test_different_shapes_are_not_mixed(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                        toy_path: pathlib.Path) -> None:
    ort_toy = session(toy_path)
    plane = up.gateway.dataplane
    plane.set_batch_cap(TOY, 2)
    try:
        inputs = [toy_inputs(1, 3, 1), toy_inputs(1, 5, 2), toy_inputs(1, 3, 3), toy_inputs(1, 5, 4)]
        before = batches(up, TOY)
        results = [r() for r in fire(up, g, TOY, [("grpc", inputs[0]), ("grpc", inputs[1]), ("http", inputs[2]),
                                                  ("http", inputs[3])], ("y", "g"))]
    finally:
        plane.set_batch_cap(TOY, None)
    assert since(before, batches(up, TOY)) == (2, 4, 4)  # two calls of two requests: width 3, then width 5
    for x, got in zip(inputs, results, strict=True):
        assert isinstance(got, dict), got
        want = dict(zip(("y", "g"), ort_toy.run(["y", "g"], x), strict=True))
        assert got["y"].shape == x["x"].shape and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_failed_batch_fails_every_request_in_it(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    plane.set_batch_cap(TOY, 2)
    try:
        before = batches(up, TOY)
        good, bad = toy_inputs(1, 4, 5), toy_inputs(1, 4, 6, bad=True)
        results = [r() for r in fire(up, g, TOY, [("grpc", good), ("grpc", bad)], ("y", "g"))]
    finally:
        plane.set_batch_cap(TOY, None)
    assert since(before, batches(up, TOY))[0] == 1
    assert all(isinstance(r, InferenceServerException) for r in results), results
    codes = {str(r.status()) for r in results if isinstance(r, InferenceServerException)}
    messages = {r.message() for r in results if isinstance(r, InferenceServerException)}
    # The model refuses the bad row (an index out of its table): the client's error, which the whole batch shares.
    assert codes == {"StatusCode.INVALID_ARGUMENT"} and len(messages) == 1 and "out of" in messages.pop()


def test_a_full_queue_answers_resource_exhausted_and_429(
        up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
        h: httpclient.InferenceServerClient, toy_path: pathlib.Path) -> None:
    ort_toy = session(toy_path)
    plane = up.gateway.dataplane
    queued = [toy_inputs(1, 2, 10 + i) for i in range(4)]  # maxQueueSize 4; 4 rows cannot fill the cap of 256
    before = batches(up, TOY)
    waiting = fire(up, g, TOY, [("grpc", x) for x in queued], ("y", "g"))
    wait_queued(up, TOY, 4)
    with pytest.raises(InferenceServerException, match="queue is full") as err:
        g.infer(TOY, infer_inputs(toy_inputs(1, 2, 20), grpcclient))
    assert str(err.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
    assert "maxQueueSize" in err.value.message()
    with pytest.raises(InferenceServerException, match="queue is full") as err:
        h.infer(TOY, infer_inputs(toy_inputs(1, 2, 21), httpclient))
    assert str(err.value.status()) == "429"
    plane.set_batch_cap(TOY, 4)  # the four waiting requests now fill a batch
    try:
        results = [r() for r in waiting]
    finally:
        plane.set_batch_cap(TOY, None)
    assert since(before, batches(up, TOY)) == (1, 4, 4)
    for x, got in zip(queued, results, strict=True):
        assert isinstance(got, dict), got
        assert np.array_equal(got["y"], ort_toy.run(["y"], x)[0])


def test_set_batch_cap(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    ort_ctr = session(defaultmodel.ensure().spec.source_path)
    inputs = [ctr_inputs(1, 30 + i) for i in range(4)]
    plane.set_batch_cap(CTR, 2)  # under the preferred size 4: batches of 2
    try:
        before = batches(up, CTR)
        capped = [r() for r in fire(up, g, CTR, [("grpc", x) for x in inputs], ("probability",))]
        assert since(before, batches(up, CTR)) == (2, 4, 4)
    finally:
        plane.set_batch_cap(CTR, None)
    before = batches(up, CTR)  # the spec's again: one batch of the preferred size 4
    restored = [r() for r in fire(up, g, CTR, [("http", x) for x in inputs], ("probability",))]
    assert since(before, batches(up, CTR)) == (1, 4, 4)
    for x, a, b in zip(inputs, capped, restored, strict=True):
        assert isinstance(a, dict) and isinstance(b, dict), (a, b)
        assert np.array_equal(a["probability"], ort_ctr.run(None, x)[0])
        assert np.array_equal(b["probability"], a["probability"])
    with pytest.raises(ValueError, match="positive"):
        plane.set_batch_cap(CTR, 0)
    with pytest.raises(errors.UnknownModel):
        plane.set_batch_cap("nope", 4)


def test_deadline_inside_the_queue(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                   h: httpclient.InferenceServerClient) -> None:
    before = batches(up, TOY)
    with pytest.raises(InferenceServerException, match="waiting in the batch queue") as err:
        g.infer(TOY, infer_inputs(toy_inputs(1, 2, 40), grpcclient), headers={"x-timeout-ms": "200"})
    assert str(err.value.status()) == "StatusCode.DEADLINE_EXCEEDED"
    with pytest.raises(InferenceServerException, match="waiting in the batch queue") as err:
        h.infer(TOY, infer_inputs(toy_inputs(1, 2, 41), httpclient), headers={"x-timeout-ms": "200"})
    assert str(err.value.status()) == "504"
    assert since(before, batches(up, TOY)) == (0, 0, 0)  # neither was sent to the worker
    assert up.gateway.dataplane.drain_load()[TOY].queue_depth == 0


def test_shed_and_unshed(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                         h: httpclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    registry = up.gateway.metrics.registry
    x = ctr_inputs(4, 50)
    shed_before = registry.get_sample_value("volga_gateway_shed_requests_total", {"model": CTR}) or 0.0
    plane.drain_load()
    plane.shed(CTR, 1500)
    try:
        with pytest.raises(InferenceServerException, match="shedding load; retry after 1500 ms") as err:
            g.infer(CTR, infer_inputs(x, grpcclient))
        assert str(err.value.status()) == "StatusCode.RESOURCE_EXHAUSTED"
        with pytest.raises(InferenceServerException, match="shedding load") as err:
            h.infer(CTR, infer_inputs(x, httpclient))
        assert str(err.value.status()) == "429"
        assert_retry_hints(up.endpoints(), CTR, x)
        # Another model is not shed.
        assert g.infer(defaultmodel.MODEL_ID, infer_inputs(x, grpcclient)).as_numpy("probability").shape == (4, 1)
    finally:
        plane.unshed(CTR)
    shed_after = registry.get_sample_value("volga_gateway_shed_requests_total", {"model": CTR})
    assert shed_after == shed_before + 4
    load = plane.drain_load()[CTR]
    assert (load.arrivals, load.shed, load.completed) == (4, 4, 0)
    answer = g.infer(CTR, infer_inputs(x, grpcclient)).as_numpy("probability")  # 4 rows: a preferred size
    assert np.array_equal(answer, session(defaultmodel.ensure().spec.source_path).run(None, x)[0])
    with pytest.raises(ValueError, match="milliseconds"):
        plane.shed(CTR, -1)


def test_drain_load(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    plane.drain_load()
    waiting = fire(up, g, TOY, [("grpc", toy_inputs(1, 2, 60 + i)) for i in range(3)], ("y",))
    wait_queued(up, TOY, 3)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: seen.append(plane.drain_load()))  # from another thread
    reader.start()
    reader.join()
    now = seen[0][TOY]
    assert (now.arrivals, now.completed, now.queue_depth, now.latencies_ms, now.shed) == (3, 0, 3, (), 0)
    plane.set_batch_cap(TOY, 3)
    try:
        assert all(isinstance(r(), dict) for r in waiting)
    finally:
        plane.set_batch_cap(TOY, None)
    g.infer(defaultmodel.MODEL_ID, infer_inputs(ctr_inputs(1, 61), grpcclient))
    loads = plane.drain_load()
    toy, default = loads[TOY], loads[defaultmodel.MODEL_ID]
    assert (toy.arrivals, toy.completed, toy.queue_depth, toy.shed, len(toy.latencies_ms)) == (0, 3, 0, 0, 3)
    assert all(ms > 0 for ms in toy.latencies_ms)
    assert (default.arrivals, default.completed, default.queue_depth, len(default.latencies_ms)) == (1, 1, 0, 1)
    assert plane.drain_load()[TOY] == type(toy)(0, 0, 0, (), 0)  # counts start again at each call


def test_model_config_reports_dynamic_batching(g: grpcclient.InferenceServerClient,
                                               h: httpclient.InferenceServerClient) -> None:
    grpc_config = g.get_model_config(CTR, as_json=True)["config"]
    assert grpc_config["max_batch_size"] == 256
    batching = grpc_config["dynamic_batching"]
    assert batching["preferred_batch_size"] == [4]
    assert int(batching["max_queue_delay_microseconds"]) == DELAY_US  # uint64: a string in protobuf's JSON
    assert batching["default_queue_policy"]["max_queue_size"] == 16
    http_config = h.get_model_config(TOY)
    assert http_config["dynamic_batching"]["max_queue_delay_microseconds"] == DELAY_US
    assert http_config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 4
    assert http_config["input"][0]["dims"] == [-1]  # [-1, -1] less the batch dimension
    assert "dynamic_batching" not in g.get_model_config(defaultmodel.MODEL_ID, as_json=True)["config"]
    assert "dynamic_batching" not in h.get_model_config(defaultmodel.MODEL_ID)
