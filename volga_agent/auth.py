"""Who may call Volga's control and data surfaces: bearer tokens for gRPC (an interceptor) and REST (a middleware).

Tokens come from a file (one per line, `#` comments; in a cluster a Secret mounted into the container), are
compared in constant time, and are checked before any handler runs: a call without a valid
`authorization: Bearer TOKEN` gets gRPC UNAUTHENTICATED or HTTP 401. Health checks stay open, so probes need no
token. The Agent API listens on a UNIX socket and loopback unless it has tokens (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import pathlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from aiohttp import web

log = logging.getLogger(__name__)
SCHEME = "bearer"


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The bearer tokens a surface accepts."""

    values: tuple[bytes, ...]

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> Tokens:
        """The tokens of a file; ValueError when it holds none."""
        lines = pathlib.Path(path).read_text().splitlines()
        values = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
        if not values:
            raise ValueError(f"{path}: no token in the file (one token per line)")
        return cls(values)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `authorization` header value carries one of the tokens; every token is compared, in
        constant time, so the answer's timing says nothing about them."""
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != SCHEME or not given:
            return False
        offered = given.strip().encode()
        matched = False
        for token in self.values:
            matched |= hmac.compare_digest(offered, token)
        return matched


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


def rest_middleware(tokens: Tokens, open_prefixes: tuple[str, ...]) -> Any:
    """An aiohttp middleware answering 401 to requests without a valid bearer token, but for `open_prefixes`."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path.startswith(open_prefixes) or tokens.accepts(request.headers.get("Authorization")):
            return await handler(request)
        return web.json_response({"error": "a bearer token is required (header 'Authorization: Bearer TOKEN')"},
                                 status=401, headers={"WWW-Authenticate": 'Bearer realm="volga"'})

    return check


def call_credentials(token: str) -> list[tuple[str, str]]:
    """The gRPC metadata that carries `token`."""
    return [("authorization", f"Bearer {token}")]
