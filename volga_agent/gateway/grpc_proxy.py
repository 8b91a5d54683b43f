"""The gateway's gRPC path to model servers that speak the Open Inference Protocol over gRPC (`protocol: oip-grpc`,
such as KServe's ModelServer or Triton): their calls of `inference.GRPCInferenceService` passed through.

The gateway's gRPC adapter (`grpc_service`) hands a call here when the model it names (the message's model name,
or `x-model-id`; both given and different is the client's error) is a model server. A server this node has no
instance of is called through the gateway of a node that has one, once (`proxy.Servers.elsewhere`,
`x-volga-forwarded`). The first call to a FROZEN
server wakes it (`proxy.Servers.lease`, single-flight on the node side), and the server is kept from being frozen
until its answer is back. The message goes on as it came, with the model's name filled in when only `x-model-id`
named it, and the client's metadata but for the connection's own (authorization, grpc-*). Bounds as for the
built-in models: the caller's deadline bounds the wake and the call (DEADLINE_EXCEEDED), and messages either way
are bounded by the gateway's request limit (the gateway's server refuses a larger request; a larger answer is
RESOURCE_EXHAUSTED). Each call opens its own channel to the server and closes it: a connection left open would be
one more socket in the server's image. Every call passed through is counted in `volga_gateway_requests` (protocol
grpc, code its status's name) and an OK one's time, wake included, in `volga_gateway_request_latency_ms`, as the HTTP
path counts its requests. A call of an overloaded node goes first to the neighbour that takes a shed model's
(`proxy.Counted.neighbour`; one answering RESOURCE_EXHAUSTED or UNAVAILABLE, or out of reach, leaves it here). While
the node's autonomy loop sheds the server, a call no neighbour took is refused before any wake (`proxy.Counted`):
RESOURCE_EXHAUSTED with trailing metadata `retry-after-ms`, as a shed model's call is. A refusal that comes back with
`retry-after-ms` (a neighbour's gateway shedding the server, or the server's own hint) keeps it. A stream, which
cannot come back once its requests went out, goes to that neighbour only while this node sheds the server (it would
be refused here): whatever that gateway answers, its refusal included, is the stream's.

A `ModelStreamInfer` stream bound to a server (by `x-model-id` or its first request: `grpc_service`) is passed
through as a stream on a channel of its own: the server woken for the first request and kept from being frozen until
the stream ends, requests sent on as they come, the server's answers streamed back as they come (a decoupled server's
several per request). A request that names another model is answered here with `error_message` and not sent on; a
server without gRPC gets every request answered with an error, unwoken. The wake's failure, or the server's stream
ending with an error status, ends the client's stream with that status; so does a shed server's refusal, which
comes where the wake would (the stream holds one lease for all its requests): a stream opened while the server is
shed (and no neighbour takes it, above) ends at once, RESOURCE_EXHAUSTED with trailer `retry-after-ms`, and a stream
already open goes on. The
stream's deadline bounds the wake and the whole stream. A stream counts once, under protocol `grpc-stream` with its
status's name, and the time to its first answer, wake included, in the latency (the gateway cannot tell which answer
ends which request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from volga_agent import errors, metrics
from volga_agent.gateway import links, oip, proxy
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
# Metadata that belongs to the client's connection or call and is not passed on.
_OWN = frozenset({"authorization", "content-type", "te", "user-agent", "host", ":authority"})
# The protocol label of a ModelStreamInfer stream (or request) in `volga_gateway_requests` and its latency.
STREAM_PROTOCOL = "grpc-stream"
# Answers of a passed-through stream read from its server ahead of the client.
_AHEAD = 64


def _passed(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if k.lower() not in _OWN and not k.lower().startswith("grpc-"))


def stream_error(request: Any, message: str) -> Any:
    """A stream's answer to a request that failed: `error_message` (Triton's way: the stream goes on), and the
    request's id and model in `infer_response`, so a client can tell which request it answers."""
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                             id=request.id))


def _retry_hint(trailer: Any) -> tuple[tuple[str, str], ...]:
    """The `retry-after-ms` of an answer's trailing metadata (a neighbour gateway's shed server, or the server's own
    hint), passed on to the client; the rest of it is not."""
    return tuple((k, v) for k, v in (trailer or ()) if k.lower() == "retry-after-ms" and isinstance(v, str))


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailer: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailer = code, details, trailer

    @classmethod
    def of(cls, exc: oip.OipError) -> _Refused:
        """A refusal before the wake (a shed server: `proxy.Counted`), with its retry hint as trailer."""
        return cls(grpc.StatusCode[exc.code], exc.message, oip.retry_after_trailer(exc))


# What a neighbour's gateway answers when it does not take a call offered to it: shed there too, or unavailable.
_DECLINED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


def _without_grpc(model: str) -> str:
    return f"{model} is a model server without gRPC (its protocol is not oip-grpc): send its requests over HTTP"


@contextlib.contextmanager
def _as_status(late: str) -> Iterator[None]:
    """What a passed-through call's or stream's wake and exchange raise, as the status its client gets (`_Refused`);
    `late` says what the deadline's passing stopped."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise _Refused(exc.code(), exc.details() or "", _retry_hint(exc.trailing_metadata())) from None
    except TimeoutError:
        raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, late) from None
    except errors.UnknownModel as exc:
        raise _Refused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
    except errors.ActivationFailed as exc:
        raise _Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
    except oip.OipError as exc:
        raise _Refused.of(exc) from None


class GrpcPass:
    """OIP gRPC calls to the model servers `servers` knows, passed through to the server's own gRPC port."""

    def __init__(self, servers: proxy.Servers, max_message_bytes: int, counts: metrics.GatewayMetrics) -> None:
        self.servers, self.counts = servers, counts
        self.options = [("grpc.max_send_message_length", max_message_bytes),
                        ("grpc.max_receive_message_length", max_message_bytes)]

    def serves(self, model_id: str) -> bool:
        return bool(model_id) and self.servers.serves(model_id)

    async def call(self, method: str, model: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """`method` of GRPCInferenceService on the server of `model`, with `request`; its answer, or the call
        aborted with the server's status (or the wake's)."""
        start = time.perf_counter()
        try:
            answer = await self._answer(method, model, request, context)
        except _Refused as refused:
            self.counts.requests.labels(model, "grpc", refused.code.name).inc()
            await context.abort(refused.code, refused.details, trailing_metadata=refused.trailer)
            raise AssertionError("unreachable: abort raises") from None
        self.counts.requests.labels(model, "grpc", "OK").inc()
        self.counts.latency.labels(model, "grpc").observe((time.perf_counter() - start) * 1e3)
        return answer

    async def stream(self, model: str, first: Any, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                     refusal: Callable[[Any], str]) -> AsyncGenerator[Any, None]:
        """A ModelStreamInfer stream bound to the server of `model`, passed through to it: `first` and then the rest
        of `requests` sent on as they come (a request `refusal` names a reason for is answered here with that
        reason as its `error_message` and not sent on), the server's answers streamed back as they come (any
        number per request). The server is woken for the first request and kept HOT until the stream ends; a wake
        that fails, or the server's stream ending with an error, ends the stream with that status. The stream
        counts once in `volga_gateway_requests` (protocol grpc-stream, code its status's name), and the time to
        its first answer, wake included, in the latency."""
        start = time.perf_counter()
        code = grpc.StatusCode.CANCELLED  # unless it ends: the client went away
        answered = False
        try:
            async with contextlib.aclosing(self._stream(model, first, requests, context, refusal)) as answers:
                async for response in answers:
                    if not answered:
                        answered = True
                        self.counts.latency.labels(model, STREAM_PROTOCOL).observe(
                            (time.perf_counter() - start) * 1e3)
                    yield response
            code = grpc.StatusCode.OK
        except _Refused as refused:
            code = refused.code
            await context.abort(refused.code, refused.details, trailing_metadata=refused.trailer)
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s: the stream passed through failed unexpectedly", model)
            await context.abort(code, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            self.counts.requests.labels(model, STREAM_PROTOCOL, code.name).inc()

    def _route(self, model: str, context: grpc.aio.ServicerContext, shed_only: bool = False
               ) -> tuple[float | None, float | None, tuple[tuple[str, str | bytes], ...], proxy.Remote | None,
                          tuple[proxy.Remote, str] | None]:
        """A passed-through call's or stream's seconds left, its deadline on the loop's clock, the metadata passed
        on, the other node's gateway that serves `model` (None: this node serves it, or the call came from
        another node's gateway, which is not passed on again), and the neighbour's gateway (and node) to offer it
        to first, this node being overloaded (`proxy.Counted.neighbour`, with `shed_only`)."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        metadata = _passed(context.invocation_metadata())
        if any(k.lower() == links.FORWARDED for k, _ in metadata):
            return remaining, deadline, metadata, None, None
        remote = self.servers.elsewhere(model)
        counted = self.servers if isinstance(self.servers, proxy.Counted) else None
        neighbour = counted.neighbour(model, shed_only) if counted is not None and remote is None else None
        return remaining, deadline, metadata, remote, neighbour

    def _passed_on(self, model: str, node: str) -> None:
        if isinstance(self.servers, proxy.Counted):
            self.servers.passed_on(model, node)

    async def _stream(self, model: str, first: Any, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      refusal: Callable[[Any], str]) -> AsyncGenerator[Any, None]:
        if not self.servers.speaks_grpc(model):
            why = f"UNIMPLEMENTED: {_without_grpc(model)}"
            request = first
            while request is not None:
                yield stream_error(request, why)
                request = await anext(requests, None)
            return
        # A stream cannot come back once its requests went out: only one this node would refuse is offered.
        remaining, deadline, metadata, remote, neighbour = self._route(model, context, shed_only=True)
        loop = asyncio.get_running_loop()
        with _as_status(f"{model}: not woken within the stream's deadline"):
            async with contextlib.AsyncExitStack() as held:
                if remote is not None:
                    address, metadata = remote.grpc_address, (*metadata, (links.FORWARDED, "1"))
                elif neighbour is not None:
                    address, metadata = neighbour[0].grpc_address, (*metadata, (links.FORWARDED, "1"))
                    self._passed_on(model, neighbour[1])
                else:
                    async with asyncio.timeout_at(deadline):
                        lease = await held.enter_async_context(self.servers.lease(model, remaining))
                    address = lease.grpc_address
                channel = await held.enter_async_context(grpc.aio.insecure_channel(address, options=self.options))
                timeout = None if deadline is None else max(0.001, deadline - loop.time())
                call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(metadata=metadata, timeout=timeout)
                async with contextlib.aclosing(_relay(call, first, requests, refusal)) as answers:
                    async for response in answers:
                        yield response

    async def _answer(self, method: str, model: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not self.servers.speaks_grpc(model):
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, _without_grpc(model))
        remaining, deadline, metadata, remote, neighbour = self._route(model, context)
        with _as_status(f"{model}: no answer within the call's deadline (waking and answering)"):
            async with asyncio.timeout_at(deadline):
                if remote is not None:
                    return await self._call(remote.grpc_address, method, request, (*metadata, (links.FORWARDED, "1")),
                                            deadline)
                if neighbour is not None:
                    try:
                        answer = await self._call(neighbour[0].grpc_address, method, request,
                                                  (*metadata, (links.FORWARDED, "1")), deadline)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in _DECLINED:
                            raise
                        log.info("%s: neighbour %s did not take the call (%s): served here", model, neighbour[1],
                                 exc.code().name)
                    else:
                        self._passed_on(model, neighbour[1])
                        return answer
                async with self.servers.lease(model, remaining) as lease:
                    return await self._call(lease.grpc_address, method, request, metadata, deadline)

    async def _call(self, address: str, method: str, request: Any, metadata: tuple[tuple[str, str | bytes], ...],
                    deadline: float | None) -> Any:
        async with grpc.aio.insecure_channel(address, options=self.options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            timeout = None if deadline is None else max(0.001, deadline - asyncio.get_running_loop().time())
            return await getattr(stub, method)(request, timeout=timeout, metadata=metadata)


async def _relay(call: Any, first: Any, requests: AsyncIterator[Any],
                 refusal: Callable[[Any], str]) -> AsyncGenerator[Any, None]:
    """The answers of the server's stream `call` as they come, while the client's requests are sent on to it (those
    `refusal` refuses answered here instead, among the server's answers)."""
    out: asyncio.Queue[Any] = asyncio.Queue(_AHEAD)

    async def send() -> None:
        request = first
        try:
            while request is not None:
                if why := refusal(request):
                    await out.put(stream_error(request, why))
                else:
                    await call.write(request)
                request = await anext(requests, None)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the server ended the stream: its status is what `receive` reads

    async def receive() -> None:
        while (response := await call.read()) is not grpc.aio.EOF:
            await out.put(response)
        if (code := await call.code()) is not grpc.StatusCode.OK:
            raise _Refused(code, await call.details() or "", _retry_hint(await call.trailing_metadata()))

    sender, receiver = asyncio.create_task(send()), asyncio.create_task(receive())
    getting: asyncio.Future[Any] | None = None
    try:
        while True:
            getting = asyncio.ensure_future(out.get())
            await asyncio.wait({getting, receiver}, return_when=asyncio.FIRST_COMPLETED)
            if getting.done():
                yield getting.result()
                continue
            getting.cancel()
            while not out.empty():  # what was queued before the server's stream ended
                yield out.get_nowait()
            receiver.result()  # its error, if it ended with one
            return
    finally:
        for task in (sender, receiver, getting):
            if task is not None:
                task.cancel()
