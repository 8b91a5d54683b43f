"""A model server that knows nothing of Volga, speaking the Open Inference Protocol over gRPC with Triton's own
generated stubs (`tritonclient.grpc.service_pb2*`, as a user's Triton-compatible server would): `ModelInfer`, and a
decoupled `ModelStreamInfer` that answers each request with N responses, as an LLM server streams its tokens. HTTP on
a second port serves the readiness probe only (GET /v2/health/ready).

Its one model, `counter`, is made at start-up (weights from a fixed seed). Input `x` (FP32, any shape); the request's
parameter `responses` (an integer, 1 to 1000; 1 when not given) is N. Response k of N (k = 0 .. N-1) carries the
request's id, `y` = tanh(x * w[k]) + k (FP32, x's shape) and `step` = [k] (INT32 [1]); the last one has the parameter
`triton_final_response` true (Triton's mark of a decoupled model's last response). `ModelInfer` answers response 0 of
1. A request the model refuses is answered, in a stream, with `error_message` (the stream goes on) and, by
`ModelInfer`, with INVALID_ARGUMENT or NOT_FOUND. A stream request with the parameter `end_stream` true ends the
stream with the status ABORTED (as a server ends a stream that cannot go on).

Run: python -m volga_bench.servers.oip_stream_app --http-port PORT --grpc-port PORT2"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from aiohttp import web
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

MODEL = "counter"
MAX_RESPONSES = 1000
# The start-up work a real server does: its weights, made once.
WEIGHTS = np.tanh(np.random.default_rng(11).standard_normal(MAX_RESPONSES)).astype(np.float32)


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _inputs(request: Any) -> tuple[np.ndarray, int]:
    """x and N of a request, or Refused naming what is wrong."""
    if request.model_name != MODEL:
        raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_name!r}: this server serves {MODEL!r}")
    named = [i for i, tensor in enumerate(request.inputs) if tensor.name == "x"]
    if len(named) != 1 or request.inputs[named[0]].datatype != "FP32":
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "input 'x' (FP32) is required, once")
    tensor = request.inputs[named[0]]
    shape = tuple(int(d) for d in tensor.shape)
    if request.raw_input_contents:
        x = np.frombuffer(request.raw_input_contents[named[0]], "<f4")
    else:
        x = np.asarray(tensor.contents.fp32_contents, np.float32)
    if x.size != int(np.prod(shape)):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"input 'x': {x.size} values for shape {list(shape)}")
    count = request.parameters["responses"].int64_param if "responses" in request.parameters else 1
    if not 1 <= count <= MAX_RESPONSES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"parameter 'responses' is {count}: 1 to {MAX_RESPONSES}")
    return x.reshape(shape), count


def _response(request: Any, x: np.ndarray, k: int, count: int) -> Any:
    y = (np.tanh(x * WEIGHTS[k]) + k).astype("<f4")
    response = pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
    response.outputs.add(name="y", datatype="FP32", shape=list(y.shape))
    response.outputs.add(name="step", datatype="INT32", shape=[1])
    response.raw_output_contents.extend([y.tobytes(), np.array([k], "<i4").tobytes()])
    response.parameters["triton_final_response"].bool_param = k == count - 1
    return response


class Counter(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]  # generated, untyped
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ModelReadyResponse(ready=request.name == MODEL)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            x, _ = _inputs(request)
        except Refused as refused:
            await context.abort(refused.code, refused.message)
        return _response(request, x, 0, 1)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in request_iterator:
            if request.parameters["end_stream"].bool_param if "end_stream" in request.parameters else False:
                await context.abort(grpc.StatusCode.ABORTED, f"request {request.id!r} asked to end the stream")
            try:
                x, count = _inputs(request)
            except Refused as refused:
                yield pb.ModelStreamInferResponse(error_message=refused.message,
                                                  infer_response=pb.ModelInferResponse(id=request.id))
                continue
            for k in range(count):
                yield pb.ModelStreamInferResponse(infer_response=_response(request, x, k, count))


async def _ready(request: web.Request) -> web.Response:
    return web.Response(text="ready")


async def serve(http_port: int, grpc_port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Counter(), server)
    if server.add_insecure_port(f"127.0.0.1:{grpc_port}") == 0:
        raise SystemExit(f"cannot listen on 127.0.0.1:{grpc_port} (gRPC)")
    await server.start()
    app = web.Application()
    app.router.add_get("/v2/health/ready", _ready)
    app.router.add_get("/v2/health/live", _ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.http_port, args.grpc_port))


if __name__ == "__main__":
    main()
