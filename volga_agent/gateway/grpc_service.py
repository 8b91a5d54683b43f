"""The gateway's gRPC adapter: `inference.GRPCInferenceService` (what tritonclient.grpc calls) over the dataplane.

Each method decodes its request with `oip`, asks the dataplane and encodes the answer; an `oip.OipError`
aborts the call with its status, and anything unexpected with INTERNAL and a short message (grpc's own
fallback would be UNKNOWN with a traceback). Nothing here decides anything (`docs/architecture.md`).

Calls that name a model server speaking OIP over gRPC (`framework: server`, `protocol: oip-grpc`) are passed through
to it (`grpc_proxy`) before anything here decodes them.

`ModelStreamInfer` (Triton's bidirectional stream: tritonclient's `start_stream` / `async_stream_infer`) is bound
by `x-model-id`, or else by the model its first request names. Bound to a model server, the whole stream is passed
through to it (`grpc_proxy.GrpcPass.stream`). Otherwise each request is answered as `ModelInfer` answers it (its
model: its `model_name` or `x-model-id`, both given and different its error; the same decoding, wake and bounds, the
stream's deadline bounding each wake), and the answers go back in the order of the requests, up to STREAM_WINDOW of
them answered at once. A request that fails is answered with `error_message` ("CODE: why") and its id, and the stream
goes on, as Triton does. Each request counts in `volga_gateway_requests` and its latency as a ModelInfer does, under
protocol `grpc-stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from volga_agent.gateway import dataplane, grpc_proxy, oip
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc

T = TypeVar("T")
# The requests of one ModelStreamInfer stream answered at once (for the gateway's own models).
STREAM_WINDOW = 64
log = logging.getLogger(__name__)
# Health checks answer without a token (auth.GrpcAuth), so probes need none.
OPEN_METHODS = ("/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return dataplane.headers(context.invocation_metadata() or ())


async def _answer(context: grpc.aio.ServicerContext, what: str, make: Callable[[], Awaitable[T]]) -> T:
    """`make()`, with an OipError as its status and anything unexpected as INTERNAL (logged once)."""
    try:
        return await make()
    except oip.OipError as exc:
        await context.abort(grpc.StatusCode[exc.code], exc.message)
    except Exception as exc:
        log.exception("gRPC %s failed unexpectedly", what)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
    raise AssertionError("unreachable: abort raises")


def _payload_bytes(request: Any) -> int:
    """The tensor bytes a ModelInfer request carries (raw contents, or 8 bytes a typed value at most)."""
    size = sum(len(raw) for raw in request.raw_input_contents)
    for tensor in request.inputs:
        if tensor.HasField("contents"):
            c = tensor.contents
            size += 8 * (len(c.bool_contents) + len(c.int_contents) + len(c.int64_contents) + len(c.uint_contents)
                         + len(c.uint64_contents) + len(c.fp32_contents) + len(c.fp64_contents))
    return size


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: dataplane.Dataplane, servers: grpc_proxy.GrpcPass | None = None) -> None:
        self.plane = plane
        self.servers = servers


    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.plane.catalog.loaded)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(name=dataplane.SERVER_NAME, version=dataplane.SERVER_VERSION,
                                         extensions=list(dataplane.EXTENSIONS))

    async def _pass(self, method: str, request: Any, context: grpc.aio.ServicerContext, field: str = "name") -> Any:
        """The call passed through to the model server it names, or None when it names none."""
        if self.servers is None:
            return None
        try:
            model = dataplane.model_id(_headers(context), getattr(request, field))
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        if not self.servers.serves(model):
            return None
        setattr(request, field, model)
        return await self.servers.call(method, model, request, context)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if (passed := await self._pass("ModelReady", request, context)) is not None:
            return passed

        async def make() -> Any:
            model = dataplane.model_id(_headers(context), request.name)
            return pb.ModelReadyResponse(ready=await self.plane.model_ready(model, request.version))

        return await _answer(context, "ModelReady", make)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if (passed := await self._pass("ModelMetadata", request, context)) is not None:
            return passed

        async def make() -> Any:
            m = await self.plane.model_metadata(dataplane.model_id(_headers(context), request.name), request.version)
            return oip.model_metadata_grpc(m.name, m.versions, m.platform, m.inputs, m.outputs)

        return await _answer(context, "ModelMetadata", make)

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if (passed := await self._pass("ModelConfig", request, context)) is not None:
            return passed

        async def make() -> Any:
            model = dataplane.model_id(_headers(context), request.name)
            return dataplane.config_grpc(await self.plane.model_config(model, request.version))

        return await _answer(context, "ModelConfig", make)

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def make() -> Any:
            response = pb.RepositoryIndexResponse()
            for m in await self.plane.repository_index():
                if m.ready or not request.ready:
                    response.models.add(name=m.name, version=m.version, state=m.state, reason=m.reason)
            return response

        return await _answer(context, "RepositoryIndex", make)

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if (passed := await self._pass("ModelInfer", request, context, "model_name")) is not None:
            return passed
        headers = _headers(context)
        try:
            model = dataplane.model_id(headers, request.model_name)
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        try:
            return await self.plane.observe(model, "grpc", lambda: self._infer(model, headers, request, context))
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message, trailing_metadata=oip.retry_after_trailer(exc))

    async def _infer(self, model: str, headers: dict[str, str], request: Any,
                     context: grpc.aio.ServicerContext) -> Any:
        """One ModelInfer request for a model of the gateway's own: decoded, inferred, encoded."""
        inputs, requested = await dataplane.off_loop(_payload_bytes(request), oip.decode_grpc_request, request)
        spec, outputs = await self.plane.infer(model, headers, inputs, context.time_remaining(),
                                               request.model_version)
        return oip.encode_grpc_response(spec.model_id, spec.version, request.id,
                                        oip.select_outputs(outputs, requested))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        """A stream of ModelInfer requests. The stream is bound by `x-model-id`, or else by its first request: when
        that names a model server, the whole stream is passed through to it (`grpc_proxy.GrpcPass.stream`);
        otherwise each request is answered as ModelInfer answers it, in order, a failed one with an
        `error_message` (the stream goes on)."""
        headers = _headers(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            return
        bound = headers.get("x-model-id") or first.model_name
        if self.servers is not None and self.servers.serves(bound):
            answers = self.servers.stream(bound, first, requests, context,
                                          lambda request: _bound_refusal(headers, bound, request))
        else:
            answers = self._stream(headers, first, requests, context)
        async with contextlib.aclosing(answers):
            async for answer in answers:
                yield answer

    async def _stream(self, headers: dict[str, str], first: Any, requests: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        """The answers to a stream's requests for the gateway's own models, in the order of the requests. Up to
        STREAM_WINDOW requests are answered at once (a batching model batches them); reading further requests
        waits for the earliest answer to be sent."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        answers: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue()
        failed: list[BaseException] = []

        async def read() -> None:
            try:
                request: Any = first
                while request is not None:
                    await window.acquire()
                    answers.put_nowait(asyncio.ensure_future(self._stream_one(headers, request, context)))
                    request = await anext(requests, None)
            except Exception as exc:  # the client's side of the stream broke: what is read is still answered
                failed.append(exc)
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (answer := await answers.get()) is not None:
                response = await answer
                window.release()
                yield response
            if failed:
                raise failed[0]
        finally:
            reader.cancel()
            while not answers.empty():
                if (left := answers.get_nowait()) is not None:
                    left.cancel()

    async def _stream_one(self, headers: dict[str, str], request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The answer to one request of a stream: its ModelInfer response, or its error as `error_message`."""
        try:
            model = dataplane.model_id(headers, request.model_name)
            if self.servers is not None and self.servers.serves(model):
                raise oip.error("INVALID_ARGUMENT", f"{model} is a model server, and this stream is for the "
                                "gateway's own models (bound by x-model-id or its first request): send the "
                                "server's requests in a stream of their own")
            response = await self.plane.observe(model, grpc_proxy.STREAM_PROTOCOL,
                                                lambda: self._infer(model, headers, request, context))
        except oip.OipError as exc:
            return grpc_proxy.stream_error(request, f"{exc.code}: {exc.message}")
        return pb.ModelStreamInferResponse(infer_response=response)


def _bound_refusal(headers: dict[str, str], bound: str, request: Any) -> str:
    """Why a request of a stream passed through to model server `bound` cannot go on to it ("" when it can): it
    names another model. A request that names none is for `bound` (its name filled in)."""
    try:
        model = dataplane.model_id(headers, request.model_name)
    except oip.OipError as exc:
        return f"{exc.code}: {exc.message}"
    if model and model != bound:
        return (f"INVALID_ARGUMENT: this stream is passed through to model server {bound!r} (named by x-model-id or "
                f"its first request), and this request names {model!r}: send it in a stream of its own")
    request.model_name = bound
    return ""
