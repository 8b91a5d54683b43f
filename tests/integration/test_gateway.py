"""The gateway against an unmodified tritonclient (gRPC and HTTP), with real workers and real CRIU."""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from traffic import infer_inputs
from tritonclient.utils import InferenceServerException

from volga_agent.app import defaultmodel
from volga_agent.app import up as volga_up
from volga_agent.worker import contract
from volga_bench import harness
from volga_core import api

# tritonclient.http's __del__ closes its gevent pool from whichever thread collects it, and warns.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
Tier = api.Tier
A, B = "ctr-default", "ctr-b"


@pytest.fixture(scope="module")
def up() -> Iterator[volga_up.Embedded]:
    first = defaultmodel.ensure()
    doc = defaultmodel.spec_document(first.spec.source_path)
    doc["metadata"]["name"] = B
    doc["spec"]["modelId"] = B
    doc["spec"]["pool"] = {"hot": 1, "frozen": 0}
    second = api.parse_model_spec(doc)
    bg, embedded = harness.start_embedded([first, second])
    bg.call(embedded.wait_converged(), timeout=300)
    yield embedded
    pids = [s.inst.pid for s in embedded.pool.slots.values() if s.inst.pid]
    bg.call(embedded.stop(), timeout=60)
    bg.close()
    assert pids and not any(pathlib.Path(f"/proc/{pid}").exists() for pid in pids)
    assert embedded.pool.criu is not None and not embedded.pool.criu.root.exists()


def name_of(up: volga_up.Embedded, model: str) -> str:
    return up.pool.instances(model)[0].name


def arrays(up: volga_up.Embedded, model: str = A, batch: int = 4) -> dict[str, np.ndarray]:
    return contract.sample_inputs(up.gateway.catalog.decls(model), batch=batch, seed=21)


def reference(up: volga_up.Embedded, model: str, x: dict[str, np.ndarray]) -> np.ndarray:
    from volga_agent.worker import protocol

    info = up.pool.activate(model).instance
    with protocol.WorkerClient(info.socket) as direct:
        return direct.infer(x)["probability"]


def test_server_and_model_metadata_grpc(g: grpcclient.InferenceServerClient) -> None:
    assert g.is_server_live() and g.is_server_ready()
    assert g.is_model_ready(A) and not g.is_model_ready("nope")
    meta = g.get_model_metadata(A, as_json=True)
    assert meta["name"] == A and meta["platform"] == "onnxruntime_onnx"
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("dense", "FP32", ["-1", "13"]), ("sparse", "INT64", ["-1", "26"])]
    index = g.get_model_repository_index(as_json=True)
    assert sorted(m["name"] for m in index["models"]) == [B, A]
    assert g.get_server_metadata(as_json=True)["name"] == "volga"


def test_server_and_model_metadata_http(h: httpclient.InferenceServerClient) -> None:
    assert h.is_server_live() and h.is_server_ready()
    assert h.is_model_ready(A) and not h.is_model_ready("nope")
    meta = h.get_model_metadata(A)
    assert meta["outputs"] == [{"name": "probability", "datatype": "FP32", "shape": [-1, 1]}]
    assert sorted(m["name"] for m in h.get_model_repository_index()) == [B, A]


def test_infer_grpc_and_http_agree_with_the_worker(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                                   h: httpclient.InferenceServerClient) -> None:
    x = arrays(up)
    want = reference(up, A, x)
    by_name = g.infer(A, infer_inputs(x)).as_numpy("probability")
    by_header = g.infer("", infer_inputs(x), headers={"x-model-id": A}).as_numpy("probability")
    both = g.infer(A, infer_inputs(x), headers={"x-model-id": A}).as_numpy("probability")
    by_http = h.infer(A, infer_inputs(x, httpclient)).as_numpy("probability")
    http_json = h.infer(A, [httpclient.InferInput(k, list(v.shape), i.datatype()).set_data_from_numpy(
        v, binary_data=False) for (k, v), i in zip(x.items(), infer_inputs(x, httpclient), strict=True)],
        outputs=[httpclient.InferRequestedOutput("probability", binary_data=False)]).as_numpy("probability")
    for got in (by_name, by_header, both, by_http, http_json):
        assert np.array_equal(got, want)


def gateway_activations(up: volga_up.Embedded, model: str = A) -> float:
    value = up.gateway.metrics.registry.get_sample_value("volga_gateway_activations_total", {"model": model})
    return value or 0.0


def test_frozen_model_wakes_once_for_200_concurrent_requests(up: volga_up.Embedded) -> None:
    name = name_of(up, A)
    up.pool.move_to(name, Tier.FROZEN)
    x = arrays(up, batch=2)
    before_pool, before_router = up.pool.activations, gateway_activations(up)

    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    results: list[Any] = []
    done = threading.Semaphore(0)

    def callback(result: Any, error: Any) -> None:
        results.append(error if error is not None else result.as_numpy("probability"))
        done.release()

    for _ in range(200):  # all in flight at once: async_infer returns before the answer
        client.async_infer(A, infer_inputs(x), callback)
    for _ in range(200):
        assert done.acquire(timeout=60)
    client.close()
    errors = [r for r in results if not isinstance(r, np.ndarray)]
    assert not errors, errors[:3]
    outs = results
    assert up.pool.activations - before_pool == 1
    assert gateway_activations(up) - before_router == 1
    want = reference(up, A, x)
    assert len(outs) == 200 and all(np.array_equal(o, want) for o in outs)


def test_a_stream_wakes_a_frozen_model_once_and_answers_in_order(up: volga_up.Embedded) -> None:
    """ModelStreamInfer: three requests in flight on one tritonclient stream to a FROZEN model wake it once; each
    answer is the worker's, with its request's id, in the order sent."""
    up.pool.move_to(name_of(up, A), Tier.FROZEN)
    xs = [arrays(up, batch=batch) for batch in (1, 3, 2)]
    before_pool, before_router = up.pool.activations, gateway_activations(up)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    try:
        client.start_stream(lambda result, error: got.put((result, error)), stream_timeout=240)
        for i, x in enumerate(xs):
            client.async_stream_infer(A, infer_inputs(x), request_id=f"q{i}")
        client.stop_stream()  # waits for every answer
    finally:
        client.close()
    answers = [got.get_nowait() for _ in xs]
    assert got.empty()
    assert up.pool.activations - before_pool == 1
    assert gateway_activations(up) - before_router == 1
    for i, ((result, error), x) in enumerate(zip(answers, xs, strict=True)):
        assert error is None, error
        assert result.get_response().id == f"q{i}"
        assert np.array_equal(result.as_numpy("probability"), reference(up, A, x))


def test_freezing_under_steady_traffic_costs_no_request(up: volga_up.Embedded) -> None:
    """The agent freezes a model while clients keep sending: requests caught by the freeze are handed back
    unrun and retried after a wake, so every one of them is answered, correctly."""
    name, x = name_of(up, A), arrays(up, batch=2)
    want = reference(up, A, x)
    stop = threading.Event()
    answers: list[Any] = []

    def client_loop() -> None:
        client = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
        try:
            while not stop.is_set():
                try:
                    answers.append(client.infer(A, infer_inputs(x)).as_numpy("probability"))
                except InferenceServerException as exc:
                    answers.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for thread in threads:
        thread.start()
    freezes = 0
    try:
        for _ in range(5):
            time.sleep(0.3)
            if up.pool.move_to(name, Tier.FROZEN) is not None:
                freezes += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    errors = [str(a) for a in answers if not isinstance(a, np.ndarray)]
    assert not errors, (len(errors), errors[:3])
    assert freezes >= 3 and len(answers) > 50
    assert all(np.array_equal(a, want) for a in answers)


def code_of(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_unknown_model(g: grpcclient.InferenceServerClient, h: httpclient.InferenceServerClient,
                       up: volga_up.Embedded) -> None:
    x = arrays(up)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
        g.infer("nope", infer_inputs(x))
    assert code_of(err.value) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'") as err:
        h.infer("nope", infer_inputs(x, httpclient))
    assert code_of(err.value) == "404"


def test_input_hash_mismatch_is_rejected_before_any_wake(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                                                         h: httpclient.InferenceServerClient) -> None:
    name = name_of(up, A)
    up.pool.move_to(name, Tier.FROZEN)
    before = up.pool.activations
    x = arrays(up)
    with pytest.raises(InferenceServerException, match="does not match model") as err:
        g.infer(A, infer_inputs(x), headers={"x-input-hash": "0" * 64})
    assert code_of(err.value) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="does not match model") as err:
        h.infer(A, infer_inputs(x, httpclient), headers={"x-input-hash": "0" * 64})
    assert code_of(err.value) == "400"
    assert up.pool.activations == before and up.pool.instances(A)[0].tier is Tier.FROZEN
    good = up.gateway.catalog.get(A).input_hash()
    assert g.infer(A, infer_inputs(x), headers={"x-input-hash": good}).as_numpy("probability").shape == (4, 1)


@pytest.mark.parametrize("bad, message", [
    (lambda x: {"dense": x["dense"][:, :5].copy(), "sparse": x["sparse"]}, "input 'dense': shape [4, 5] given"),
    (lambda x: {"dense": x["dense"], "sparse": x["sparse"].astype(np.float32)}, "input 'sparse': dtype FP32"),
    (lambda x: {"dense": x["dense"]}, "inputs missing ['sparse']"),
])
def test_malformed_tensors(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                           h: httpclient.InferenceServerClient, bad: Any, message: str) -> None:
    x = bad(arrays(up))
    with pytest.raises(InferenceServerException, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        g.infer(A, infer_inputs(x))
    assert code_of(err.value) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as err:
        h.infer(A, infer_inputs(x, httpclient))
    assert code_of(err.value) == "400"
    assert g.infer(A, infer_inputs(arrays(up))).as_numpy("probability").shape == (4, 1)


def test_oversized_body(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                        h: httpclient.InferenceServerClient) -> None:
    big = {"dense": np.zeros((2**21, 13), np.float32), "sparse": np.zeros((2**21, 26), np.int64)}  # ~540 MB
    with pytest.raises(InferenceServerException) as err:
        g.infer(A, infer_inputs(big))
    assert code_of(err.value) == "StatusCode.RESOURCE_EXHAUSTED"
    with pytest.raises(InferenceServerException) as err:
        h.infer(A, infer_inputs(big, httpclient))
    assert code_of(err.value) == "413"
    assert g.infer(A, infer_inputs(arrays(up))).as_numpy("probability").shape == (4, 1)


def test_expired_deadline(up: volga_up.Embedded, g: grpcclient.InferenceServerClient,
                          h: httpclient.InferenceServerClient) -> None:
    name = name_of(up, A)
    x = arrays(up)
    up.pool.move_to(name, Tier.FROZEN)
    with pytest.raises(InferenceServerException, match="deadline") as err:
        g.infer(A, infer_inputs(x), headers={"x-timeout-ms": "1"})
    assert code_of(err.value) == "StatusCode.DEADLINE_EXCEEDED"
    time.sleep(1.0)  # the wake went on without the impatient caller
    up.pool.move_to(name, Tier.FROZEN)
    with pytest.raises(InferenceServerException, match="deadline") as err:
        h.infer(A, infer_inputs(x, httpclient), headers={"x-timeout-ms": "1"})
    assert code_of(err.value) == "504"
    with pytest.raises(InferenceServerException, match="not a number"):
        g.infer(A, infer_inputs(x), headers={"x-timeout-ms": "soon"})
    assert g.infer(A, infer_inputs(x), headers={"x-timeout-ms": "30000"}).as_numpy("probability").shape == (4, 1)


def test_worker_killed_mid_request(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    x, y = arrays(up), arrays(up, B)
    assert g.infer(A, infer_inputs(x)) is not None
    slot = up.pool.slots[name_of(up, A)]
    pid = slot.inst.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # hold the worker so the request is surely in flight when it dies
    errors: list[Exception] = []

    def send() -> None:
        try:
            g.infer(A, infer_inputs(x))
        except InferenceServerException as exc:
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert len(errors) == 1 and code_of(errors[0]) == "StatusCode.UNAVAILABLE"
    assert "mid-request" in str(errors[0])
    other = grpcclient.InferenceServerClient(up.endpoints()["grpc"])
    assert np.array_equal(other.infer(B, infer_inputs(y)).as_numpy("probability"), reference(up, B, y))
    # The next request finds the worker dead and restarts the instance.
    out = g.infer(A, infer_inputs(x)).as_numpy("probability")
    assert np.array_equal(out, reference(up, A, x))
    assert slot.inst.pid not in (None, pid)
    other.close()


def test_metrics_endpoint(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    g.infer(A, infer_inputs(arrays(up)))
    text = urllib.request.urlopen(up.endpoints()["metrics"], timeout=10).read().decode()
    for name in ("volga_snapshot_restore_latency_ms_bucket", "volga_gateway_requests_total",
                 "volga_gateway_zero_copy_latency_ms_count", "volga_emis_active_total",
                 "volga_gateway_request_latency_ms_bucket"):
        assert name in text, name
    assert 'volga_gateway_requests_total{code="OK",model="ctr-default",protocol="grpc"}' in text
    # Unknown model names (test_unknown_model sent "nope") are counted under one label, not their own.
    assert 'model="nope"' not in text and 'code="NOT_FOUND",model="_unknown"' in text


def test_shared_memory_is_used_and_leaves_no_files(up: volga_up.Embedded, g: grpcclient.InferenceServerClient) -> None:
    before = up.gateway.metrics.zero_copy_latency._sum.get()  # type: ignore[attr-defined]
    g.infer(A, infer_inputs(arrays(up)))
    assert up.gateway.metrics.zero_copy_latency._sum.get() > before  # type: ignore[attr-defined]
    assert not list(pathlib.Path("/dev/shm").glob(f"volga-shm-{os.getpid()}-*"))
