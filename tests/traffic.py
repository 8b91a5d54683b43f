"""Requests for the tests that load a real gateway: for one model from a thread, one after another (`Traffic`);
tritonclient's inputs for arrays; the retry hints of a shed model's refusals."""

from __future__ import annotations

import math
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from volga_agent.gateway import oip
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc


def infer_inputs(x: dict[str, np.ndarray], module: Any = grpcclient) -> list[Any]:
    """tritonclient InferInputs for the arrays, FP32 or else INT64 (`module`: tritonclient.grpc, or .http)."""
    out = []
    for name, value in x.items():
        item = module.InferInput(name, list(value.shape), "FP32" if value.dtype == np.float32 else "INT64")
        item.set_data_from_numpy(value)
        out.append(item)
    return out


def assert_retry_hints(endpoints: Mapping[str, str], model: str, x: dict[str, np.ndarray]) -> None:
    """A request for the shed model is refused with the retry hints, which tritonclient does not show: gRPC's
    trailer and REST's header (1500 ms)."""
    with grpc.insecure_channel(endpoints["grpc"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as rpc_err:
            stub.ModelInfer(oip.encode_grpc_request(model, x), timeout=30)
    assert rpc_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(rpc_err.value.trailing_metadata())["retry-after-ms"] == "1500"
    request = urllib.request.Request(f"{endpoints['http']}/v2/models/{model}/infer", method="POST",
                                     data=b'{"inputs": []}', headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=30)
    assert http_err.value.code == 429 and http_err.value.headers["Retry-After"] == str(math.ceil(1.5))


class Traffic:
    """Requests for one model from a thread, one after another, until stopped."""

    def __init__(self, grpc_address: str, model: str, inputs: list[Any]) -> None:
        self.client = grpcclient.InferenceServerClient(grpc_address)
        self.model, self.inputs = model, inputs
        self.stop = threading.Event()
        self.answered = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.client.infer(self.model, self.inputs)
            self.answered += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.client.close()
