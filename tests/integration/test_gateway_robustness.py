"""The gateway against hostile and unusual requests, and what it says about models: real workers, the real
gateway of `volga up` (and a sidecar-style gateway over the Agent API), unmodified tritonclient and raw HTTP.

Two models: `nan` (a tiny ONNX model whose outputs are NaN and infinities for some inputs) and `broken` (a
file that is no model, so its worker cannot start).
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import pathlib
import queue
import socket
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from volga_agent.app import up as volga_up
from volga_agent.gateway import app, catalog, dataplane, links, oip
from volga_bench import harness
from volga_core import api

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
NAN, BROKEN = "nan", "broken"
MAX_BATCH = 8


def nan_model(path: pathlib.Path) -> pathlib.Path:
    """x (FP32 [-1, 3]) -> root = sqrt(x), log = log(x), inv = 1/x: NaN and +-Infinity for x <= 0."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 3]) for n in ("root", "log", "inv")]
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["root"]), helper.make_node("Log", ["x"], ["log"]),
                               helper.make_node("Reciprocal", ["x"], ["inv"])], "nan", [x], outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def spec(model_id: str, source: pathlib.Path) -> api.ModelSpec:
    tensor = {"dtype": "FP32", "shape": [-1, 3]}
    return api.parse_model_spec({
        "apiVersion": api.API_VERSION, "kind": "ModelSpec", "metadata": {"name": model_id},
        "spec": {"modelId": model_id, "framework": "onnx", "source": f"file://{source}",
                 "inputs": [{"name": "x", **tensor}],
                 "outputs": [{"name": n, **tensor} for n in ("root", "log", "inv")],
                 "pool": {"hot": 1, "frozen": 0},
                 "runtime": {"warmupIterations": 1, "intraOpThreads": 1, "maxBatchSize": MAX_BATCH}}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[harness.Background, volga_up.Embedded]]:
    root = tmp_path_factory.mktemp("models")
    broken = root / "broken.onnx"
    broken.write_bytes(b"this is not an ONNX model")
    bg, embedded = harness.start_embedded([spec(NAN, nan_model(root / "nan.onnx")), spec(BROKEN, broken)])
    bg.call(embedded.wait_converged(), timeout=300)
    yield bg, embedded
    bg.call(embedded.stop(), timeout=60)
    bg.close()


@pytest.fixture(scope="module")
def up(stack: tuple[harness.Background, volga_up.Embedded]) -> volga_up.Embedded:
    return stack[1]


X = np.array([[-1.0, 0.0, 4.0], [1.0, 2.0, 0.25]], np.float32)


def infer_input(module: Any, x: np.ndarray = X, binary: bool = True) -> list[Any]:
    item = module.InferInput("x", list(x.shape), "FP32")
    if module is httpclient:
        item.set_data_from_numpy(x, binary_data=binary)
    else:
        item.set_data_from_numpy(x)
    return [item]


def requests_counted(up: volga_up.Embedded, code: str, protocol: str, model: str = NAN) -> float:
    value = up.gateway.metrics.registry.get_sample_value(
        "volga_gateway_requests_total", {"model": model, "protocol": protocol, "code": code})
    return value or 0.0


def post(up: volga_up.Embedded, body: bytes, headers: dict[str, str] | None = None,
         model: str = NAN) -> tuple[int, bytes]:
    url = urllib.parse.urlsplit(up.endpoints()["http"])
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=120)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def json_request(x: np.ndarray = X) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.reshape(-1).tolist()}]}).encode()


# --- NaN and infinities ---------------------------------------------------------------------------------------


def test_non_finite_outputs_are_valid_json(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                           h: httpclient.InferenceServerClient) -> None:
    with np.errstate(divide="ignore", invalid="ignore"):
        want = {"root": np.sqrt(X), "log": np.log(X), "inv": 1 / X}
    assert np.isnan(want["root"][0, 0]) and np.isinf(want["log"][0, 1]) and np.isinf(want["inv"][0, 1])
    outputs = [httpclient.InferRequestedOutput(n, binary_data=False) for n in want]
    by_json = h.infer(NAN, infer_input(httpclient, binary=False), outputs=outputs)
    by_grpc = g.infer(NAN, infer_input(grpcclient))
    for name, value in want.items():
        np.testing.assert_allclose(by_json.as_numpy(name), value, rtol=1e-6)
        np.testing.assert_allclose(by_grpc.as_numpy(name), value, rtol=1e-6)
    # The body itself is JSON: no bare NaN or Infinity tokens.
    status, body = post(up, json_request())
    assert status == 200
    doc = json.loads(body, parse_constant=lambda token: pytest.fail(f"bare {token} in the response"))
    data = {o["name"]: o["data"] for o in doc["outputs"]}
    assert data["root"][0] == "NaN" and data["log"][1] == "-Infinity" and data["inv"][1] == "Infinity"


# --- model configuration ---------------------------------------------------------------------------------------


def test_model_config_grpc_and_http(g: grpcclient.InferenceServerClient, h: httpclient.InferenceServerClient) -> None:
    config = g.get_model_config(NAN).config
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        NAN, "onnxruntime_onnx", "onnxruntime", MAX_BATCH)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("x", 11, [3])]  # 11: TYPE_FP32
    assert [o.name for o in config.output] == ["root", "log", "inv"]
    as_json = g.get_model_config(NAN, as_json=True)["config"]
    assert as_json["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["3"]}]
    rest = h.get_model_config(NAN)
    assert (rest["name"], rest["platform"], rest["max_batch_size"]) == (NAN, "onnxruntime_onnx", MAX_BATCH)
    assert rest["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}]
    assert rest["output"][2] == {"name": "inv", "data_type": "TYPE_FP32", "dims": [3]}
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
        g.get_model_config("nope")
    assert str(err.value.status()) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
        h.get_model_config("nope")
    assert str(err.value.status()) == "404"


# --- ModelStreamInfer ------------------------------------------------------------------------------------------


def streamed(up: volga_up.Embedded, send: Any, headers: dict[str, str] | None = None) -> list[tuple[Any, Any]]:
    """What an unmodified tritonclient's stream callback got, in order, for the requests `send(client)` made."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    try:
        client.start_stream(lambda result, error: answers.put((result, error)), stream_timeout=120, headers=headers)
        send(client)
        client.stop_stream()  # waits for the answers of every request sent
    finally:
        client.close()
    return [answers.get_nowait() for _ in range(answers.qsize())]


def test_a_stream_answers_each_request_as_model_infer_does_and_goes_on_past_a_bad_one(
        up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    xs = [np.array([[float(i) - 1.5, 0.0, 4.0 + i], [1.0, 2.0 * i, 0.25]], np.float32) for i in range(4)]
    unary = [g.infer(NAN, infer_input(grpcclient, x)) for x in xs]
    ok, unknown = requests_counted(up, "OK", "grpc-stream"), requests_counted(up, "NOT_FOUND", "grpc-stream",
                                                                              dataplane.UNKNOWN_MODEL_LABEL)

    def send(client: grpcclient.InferenceServerClient) -> None:
        for i, x in enumerate(xs[:2]):
            client.async_stream_infer(NAN, infer_input(grpcclient, x), request_id=f"r{i}")
        client.async_stream_infer("nope", infer_input(grpcclient, xs[0]), request_id="bad")
        for i, x in enumerate(xs[2:], 2):
            client.async_stream_infer(NAN, infer_input(grpcclient, x), request_id=f"r{i}")

    answers = streamed(up, send)
    assert len(answers) == 5
    result, error = answers[2]
    assert result is None and "NOT_FOUND: unknown model 'nope'" in str(error)
    for (result, error), want, i in zip(answers[:2] + answers[3:], unary, range(4), strict=True):
        assert error is None, error
        response = result.get_response()
        assert (response.id, response.model_name) == (f"r{i}", NAN)
        for name in ("root", "log", "inv"):
            np.testing.assert_array_equal(result.as_numpy(name), want.as_numpy(name))
    assert requests_counted(up, "OK", "grpc-stream") - ok == 4
    assert requests_counted(up, "NOT_FOUND", "grpc-stream", dataplane.UNKNOWN_MODEL_LABEL) - unknown == 1


def test_a_stream_named_by_x_model_id_refuses_a_request_for_another_model(
        up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    def send(client: grpcclient.InferenceServerClient) -> None:
        client.async_stream_infer("", infer_input(grpcclient), request_id="a")
        client.async_stream_infer(BROKEN, infer_input(grpcclient), request_id="b")
        client.async_stream_infer(NAN, infer_input(grpcclient), request_id="c")

    answers = streamed(up, send, headers={"x-model-id": NAN})
    assert [(r.get_response().id if r is not None else None) for r, _ in answers] == ["a", None, "c"]
    assert answers[1][0] is None and "INVALID_ARGUMENT: x-model-id 'nan' and the request's model name 'broken' " \
        "name different models" in str(answers[1][1])
    np.testing.assert_array_equal(answers[2][0].as_numpy("inv"), g.infer(NAN, infer_input(grpcclient)).as_numpy("inv"))


# --- readiness -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["agent-grpc", "in-process", "volga-up"])
def gateway(request: pytest.FixtureRequest,
            stack: tuple[harness.Background, volga_up.Embedded]) -> Iterator[app.Gateway]:
    """A gateway that asks the agent about instances: over the Agent API (the sidecar), in-process, or the one
    `volga up` itself serves."""
    bg, embedded = stack
    if request.param == "volga-up":
        yield embedded.gateway
        return

    async def make() -> app.Gateway:  # on the loop it serves from: grpc.aio channels belong to one loop
        link: links.AgentLink
        if request.param == "agent-grpc":
            link = links.GrpcAgentLink(embedded.endpoints()["agent"])
        else:
            link = links.LocalAgentLink(embedded._activate, lambda m: embedded.pool.instances(m, include_failed=True))
        gw = app.Gateway(catalog.Catalog(embedded.specs), link, app.Settings(http_port=0, grpc_port=0, metrics_port=0))
        await gw.start()
        return gw

    gw = bg.call(make())
    yield gw
    bg.call(gw.stop())


def test_a_model_whose_worker_cannot_start_is_not_ready(up: volga_up.Embedded, gateway: app.Gateway) -> None:
    [broken] = up.pool.instances(BROKEN)
    assert broken.tier is api.Tier.COLD and "WorkerStartError" in broken.state_reason
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ports['grpc']}")
    h = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ports['http']}")
    try:
        assert g.is_model_ready(NAN) and h.is_model_ready(NAN)
        assert not g.is_model_ready(BROKEN) and not h.is_model_ready(BROKEN)
        by_grpc = {m["name"]: m for m in g.get_model_repository_index(as_json=True)["models"]}
        by_http = {m["name"]: m for m in h.get_model_repository_index()}
        for index in (by_grpc, by_http):
            assert index[NAN]["state"] == "READY" and index[NAN]["reason"] == "HOT (1 instance)"
            assert index[BROKEN]["state"] == "UNAVAILABLE"
            assert index[BROKEN]["reason"].startswith("COLD (1 instance); broken-")
            assert "WorkerStartError" in index[BROKEN]["reason"]
        assert list(by_grpc) == list(by_http) == [BROKEN, NAN]
    finally:
        g.close()
        h.close()


# --- bad requests: a clear 4xx, counted with their code ---------------------------------------------------------


def test_bad_timeouts_are_rejected_and_counted(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                               h: httpclient.InferenceServerClient) -> None:
    ok_grpc, ok_http = requests_counted(up, "OK", "grpc"), requests_counted(up, "OK", "http")
    bad_grpc, bad_http = requests_counted(up, "INVALID_ARGUMENT", "grpc"), requests_counted(up, "INVALID_ARGUMENT",
                                                                                             "http")
    values = ["inf", "nan", "1e400", "-5", "0", "soon", "-inf", "1e12"]
    for value in values:
        with pytest.raises(InferenceServerException, match="x-timeout-ms") as err:
            g.infer(NAN, infer_input(grpcclient), headers={"x-timeout-ms": value})
        assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT", value
        with pytest.raises(InferenceServerException, match="x-timeout-ms") as err:
            h.infer(NAN, infer_input(httpclient), headers={"x-timeout-ms": value})
        assert str(err.value.status()) == "400", value
    assert requests_counted(up, "INVALID_ARGUMENT", "grpc") - bad_grpc == len(values)
    assert requests_counted(up, "INVALID_ARGUMENT", "http") - bad_http == len(values)
    assert (requests_counted(up, "OK", "grpc"), requests_counted(up, "OK", "http")) == (ok_grpc, ok_http)
    assert g.infer(NAN, infer_input(grpcclient), headers={"x-timeout-ms": "30000.5"}).as_numpy("inv").shape == (2, 3)


def binary_request(header: dict[str, Any], data: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + data, len(head)


def test_malformed_bodies_and_headers(up: volga_up.Embedded) -> None:
    raw = X.tobytes()
    good_header = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3],
                               "parameters": {"binary_data_size": len(raw)}}]}
    body, length = binary_request(good_header, raw)
    huge = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 2**62], "parameters": {"binary_data_size": 0}}]}
    huge_body, huge_length = binary_request(huge, b"")
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (b"[" * 200_000 + b"]" * 200_000, {}, 400, "nests too deeply"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": ' + b"[" * 100_000 + b"1"
         + b"]" * 100_000 + b"}]}", {}, 400, "nests too deeply"),
        (json_request(), {"Content-Encoding": "gzip"}, 400, "Content-Encoding gzip: the body is not valid gzip"),
        (json_request(), {"Content-Encoding": "deflate"}, 400, "Content-Encoding deflate"),
        (gzip.compress(json_request())[:-10], {"Content-Encoding": "gzip"}, 400, "truncated"),
        (gzip.compress(b" " * 70 * 2**20), {"Content-Encoding": "gzip"}, 413, "decompresses to over"),
        (json_request(), {"Content-Encoding": "br"}, 415, "Content-Encoding 'br' is not supported"),
        (body, {"Inference-Header-Content-Length": "12abc"}, 400, "Inference-Header-Content-Length '12abc'"),
        (body, {"Inference-Header-Content-Length": "-3"}, 400, "Inference-Header-Content-Length is -3"),
        (body, {"Inference-Header-Content-Length": str(len(body) + 1)}, 400, "Inference-Header-Content-Length is"),
        (body, {"Inference-Header-Content-Length": str(length - 1)}, 400, "request JSON is malformed"),
        (body, {"Inference-Header-Content-Length": "9" * 5000}, 400, "Inference-Header-Content-Length"),
        (huge_body, {"Inference-Header-Content-Length": str(huge_length)}, 400, "is too large"),
    ]
    ok, bad = requests_counted(up, "OK", "http"), requests_counted(up, "INVALID_ARGUMENT", "http")
    too_big = requests_counted(up, "RESOURCE_EXHAUSTED", "http")
    for payload, headers, status, message in cases:
        got, answer = post(up, payload, headers)
        assert (got, message) == (status, message) and message in json.loads(answer)["error"], answer[:300]
    assert requests_counted(up, "INVALID_ARGUMENT", "http") - bad == len(cases) - 1
    assert requests_counted(up, "RESOURCE_EXHAUSTED", "http") - too_big == 1
    assert requests_counted(up, "OK", "http") == ok
    # The well-formed versions of the same requests.
    assert post(up, body, {"Inference-Header-Content-Length": str(length)})[0] == 200
    for encoding, packed in (("gzip", gzip.compress(json_request())), ("deflate", zlib.compress(json_request()))):
        status, answer = post(up, packed, {"Content-Encoding": encoding})
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["name"] == "root"


def test_compressed_requests_from_tritonclient(h: httpclient.InferenceServerClient) -> None:
    with np.errstate(divide="ignore"):
        want = 1 / X
    for algorithm in ("gzip", "deflate"):
        for binary in (True, False):
            result = h.infer(NAN, infer_input(httpclient, binary=binary), request_compression_algorithm=algorithm)
            np.testing.assert_array_equal(result.as_numpy("inv"), want)


def test_unexpected_errors_are_internal_and_counted(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                                    h: httpclient.InferenceServerClient,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    before = {p: requests_counted(up, "INTERNAL", p) for p in ("grpc", "http")}
    ok = {p: requests_counted(up, "OK", p) for p in ("grpc", "http")}
    monkeypatch.setattr(up.gateway.dataplane.catalog, "check_inputs", boom)
    with pytest.raises(InferenceServerException, match="internal error: RuntimeError: boom") as err:
        g.infer(NAN, infer_input(grpcclient))
    assert str(err.value.status()) == "StatusCode.INTERNAL"
    with pytest.raises(InferenceServerException, match="internal error: RuntimeError: boom") as err:
        h.infer(NAN, infer_input(httpclient))
    assert str(err.value.status()) == "500"
    assert {p: requests_counted(up, "INTERNAL", p) - before[p] for p in before} == {"grpc": 1, "http": 1}
    assert {p: requests_counted(up, "OK", p) for p in ok} == ok
    # Outside the request path too: a metadata call that fails unexpectedly is INTERNAL, not UNKNOWN.
    monkeypatch.setattr(up.gateway.dataplane, "model_metadata", boom)
    with pytest.raises(InferenceServerException, match="internal error: RuntimeError: boom") as err:
        g.get_model_metadata(NAN)
    assert str(err.value.status()) == "StatusCode.INTERNAL"
    with pytest.raises(InferenceServerException, match="internal error: RuntimeError: boom") as err:
        h.get_model_metadata(NAN)
    assert str(err.value.status()) == "500"


def test_a_client_that_goes_away_is_one_log_line(up: volga_up.Embedded, caplog: pytest.LogCaptureFixture) -> None:
    url = urllib.parse.urlsplit(up.endpoints()["http"])
    cancelled = requests_counted(up, "CANCELLED", "http")
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            with socket.create_connection((url.hostname, url.port)) as conn:
                conn.sendall(f"POST /v2/models/{NAN}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
                             .encode() + b"{" * 1000)
                time.sleep(0.2)
        deadline = time.monotonic() + 10
        while requests_counted(up, "CANCELLED", "http") - cancelled < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert requests_counted(up, "CANCELLED", "http") - cancelled == 3
    mine = [r for r in caplog.records if r.name.startswith(("volga", "aiohttp"))]
    assert not [r for r in mine if r.exc_info or r.levelno >= logging.ERROR], [r.getMessage() for r in mine]
    assert len([r for r in mine if "went away" in r.getMessage()]) == 3


# --- route cache ------------------------------------------------------------------------------------------------


def test_device_hints_do_not_grow_the_route_cache(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    router = up.gateway.dataplane.router
    router.max_routes = 16
    for i in range(60):
        result = g.infer(NAN, infer_input(grpcclient), headers={"x-device-hint": f"made-up-{i}"})
        assert result.as_numpy("root").shape == (2, 3)
    assert router.cached() <= 16


# --- a large body does not hold up the others -------------------------------------------------------------------


def test_a_large_json_body_is_decoded_off_the_event_loop(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """While a ~25 MB JSON request is being decoded, small requests sent after its decoding began are answered
    before it ends (with the decoding on the event loop, none could be)."""
    window: list[float] = []
    real = oip.decode_rest_request

    def watched(body: bytes, header_length: int | None, yielding: bool = False) -> oip.RestRequest:
        large = len(body) > 2**20
        if large:
            window.append(time.monotonic())
        try:
            return real(body, header_length, yielding)
        finally:
            if large:
                window.append(time.monotonic())

    monkeypatch.setattr(oip, "decode_rest_request", watched)
    rows = 1_500_000
    big = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 3],
                                  "data": [0.5, 1.25, 2.0] * rows}]}).encode()
    assert 20 * 2**20 < len(big) < 60 * 2**20
    answer: list[tuple[int, bytes]] = []
    sender = threading.Thread(target=lambda: answer.append(post(up, big)))
    small: list[tuple[float, float]] = []
    sender.start()
    while sender.is_alive():
        sent = time.monotonic()
        assert g.infer(NAN, infer_input(grpcclient)).as_numpy("inv").shape == (2, 3)
        small.append((sent, time.monotonic()))
    sender.join()
    status, body = answer[0]
    assert status == 400 and f"over maxBatchSize {MAX_BATCH}" in json.loads(body)["error"]  # decoded, then checked
    start, end = window
    during = [s for s in small if s[0] > start and s[1] < end]
    assert len(during) >= 3, (end - start, len(small), len(during))


# --- a sidecar that starts before its agent ---------------------------------------------------------------------


def test_a_sidecar_started_before_its_agent_answers_once_the_agent_listens(
        stack: tuple[harness.Background, volga_up.Embedded]) -> None:
    """The sidecar's load exchange fails while nothing listens on the agent's port, and gRPC's channel backs off
    further after each failure (1 s, 1.6 s, 2.6 s, ... by default): a request that came between two attempts
    used to fail at once with the last one's "connection refused", though the agent was listening by then."""
    from volga_agent.app import server
    from volga_bench import controlplane

    bg, embedded = stack
    [port] = controlplane.free_ports(1)

    async def sidecar() -> tuple[app.Gateway, links.Exchanger]:
        link = links.GrpcAgentLink(f"127.0.0.1:{port}")
        gw = app.Gateway(catalog.Catalog(embedded.specs), link, app.Settings(http_port=0, grpc_port=0, metrics_port=0))
        await gw.start()
        exchanger = links.Exchanger(gw.dataplane, link)
        exchanger.start()
        return gw, exchanger

    gw, exchanger = bg.call(sidecar())
    agent: Any = None
    g = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ports['grpc']}")
    try:
        time.sleep(6.0)  # four or five failed attempts: the channel's next one is seconds away
        assert exchanger.exchanges == 0
        agent, bound = bg.call(server.serve(embedded.pool, "127.0.0.1", port))
        assert bound == port
        x = np.array([[1.0, 4.0, 0.25]], np.float32)
        answer = g.infer(NAN, infer_input(grpcclient, x), client_timeout=30).as_numpy("root")
        np.testing.assert_array_equal(answer, np.sqrt(x))
    finally:
        g.close()
        bg.call(exchanger.stop())
        bg.call(gw.stop())
        if agent is not None:
            bg.call(agent.stop(0))


# --- the autonomy loop's guarded throttle ----------------------------------------------------------------------


class RecordingGuard:
    def __init__(self, protected: set[str]) -> None:
        self.protected = protected
        self.events: list[str] = []

    def protects(self, model: str) -> bool:
        return model in self.protected

    def enter(self) -> None:
        self.events.append("enter")

    def leave(self) -> None:
        self.events.append("leave")


def test_worker_calls_of_protected_models_are_marked_in_flight(up: volga_up.Embedded,
                                                               g: grpcclient.InferenceServerClient) -> None:
    plane = up.gateway.dataplane
    guard = RecordingGuard({NAN})
    plane.set_guard(guard)
    try:
        g.infer(NAN, infer_input(grpcclient))
        with pytest.raises(InferenceServerException):
            g.infer(BROKEN, infer_input(grpcclient))  # not protected (and its worker never starts)
        assert guard.events == ["enter", "leave"]
        guard.protected = {BROKEN}
        g.infer(NAN, infer_input(grpcclient))
        assert guard.events == ["enter", "leave"]
    finally:
        plane.set_guard(None)
