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
path counts its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from volga_agent import errors, metrics
from volga_agent.gateway import links, proxy
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
# Metadata that belongs to the client's connection or call and is not passed on.
_OWN = frozenset({"authorization", "content-type", "te", "user-agent", "host", ":authority"})


def _passed(metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if k.lower() not in _OWN and not k.lower().startswith("grpc-"))


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


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
            await context.abort(refused.code, refused.details)
            raise AssertionError("unreachable: abort raises") from None
        self.counts.requests.labels(model, "grpc", "OK").inc()
        self.counts.latency.labels(model, "grpc").observe((time.perf_counter() - start) * 1e3)
        return answer

    async def _answer(self, method: str, model: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not self.servers.speaks_grpc(model):
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, f"{model} is a model server without gRPC (its protocol is "
                           "not oip-grpc): send its requests over HTTP")
        remaining = context.time_remaining()
        loop = asyncio.get_running_loop()
        deadline = None if remaining is None else loop.time() + remaining
        metadata = _passed(context.invocation_metadata())
        forwarded = any(k.lower() == links.FORWARDED for k, _ in metadata)
        remote = None if forwarded else self.servers.elsewhere(model)
        try:
            async with asyncio.timeout_at(deadline):
                if remote is not None:
                    return await self._call(remote.grpc_address, method, request, (*metadata, (links.FORWARDED, "1")),
                                            deadline)
                async with self.servers.lease(model, remaining) as lease:
                    return await self._call(lease.grpc_address, method, request, metadata, deadline)
        except grpc.aio.AioRpcError as exc:
            raise _Refused(exc.code(), exc.details() or "") from None
        except TimeoutError:
            raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{model}: no answer within the call's deadline (waking and answering)") from None
        except errors.UnknownModel as exc:
            raise _Refused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except errors.ActivationFailed as exc:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    async def _call(self, address: str, method: str, request: Any, metadata: tuple[tuple[str, str | bytes], ...],
                    deadline: float | None) -> Any:
        async with grpc.aio.insecure_channel(address, options=self.options) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            timeout = None if deadline is None else max(0.001, deadline - asyncio.get_running_loop().time())
            return await getattr(stub, method)(request, timeout=timeout, metadata=metadata)
