"""Who may call Volga's control and data surfaces: bearer tokens for gRPC (an interceptor) and REST (a middleware).

Tokens come from a file (one per line, `#` comments; in a cluster a Secret mounted into the container; the
tokens and the REST middleware live in `volga_core.http`, which the operator shares), are
compared in constant time, and are checked before any handler runs: a call without a valid
`authorization: Bearer TOKEN` gets gRPC UNAUTHENTICATED or HTTP 401. Health checks stay open, so probes need no
token. The Agent API listens on a UNIX socket and loopback unless it has tokens (docs/security.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from volga_core import http

log = logging.getLogger(__name__)

# The tokens and the REST guard are the operator's too (its /metrics): one implementation, in the kit both share.
Tokens = http.Tokens
rest_middleware = http.rest_middleware


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches only this machine."""
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    pairs: Iterable[tuple[str, Any]] = getattr(details, "invocation_metadata", None) or ()
    return {key.lower(): value for key, value in pairs if isinstance(value, str)}


class GrpcAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without a valid bearer token with UNAUTHENTICATED, but for the `open` methods."""

    def __init__(self, tokens: Tokens, open_methods: Iterable[str] = ()) -> None:
        self.tokens = tokens
        self.open_methods = frozenset(open_methods)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = str(getattr(details, "method", ""))
        if handler is None or method in self.open_methods:
            return handler
        if self.tokens.accepts(_metadata(details).get("authorization")):
            return handler
        return _refusal(handler, method)


def _refusal(handler: Any, method: str) -> Any:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without running it."""
    message = f"{method}: a bearer token is required (metadata 'authorization: Bearer TOKEN')"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(unary, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    return grpc.stream_stream_rpc_method_handler(unary, **codec)


def call_credentials(token: str) -> list[tuple[str, str]]:
    """The gRPC metadata that carries `token`."""
    return [("authorization", f"Bearer {token}")]
