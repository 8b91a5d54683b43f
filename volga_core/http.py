"""Bearer tokens and the `/metrics` endpoint they guard, shared by the operator and the node daemons.

Every Volga process serves its Prometheus metrics the same way: `GET /metrics` of its own registries, with an
optional token file (`--metrics-token-file`; in a cluster a Secret mounted into the container). Tokens are
compared in constant time and checked before any handler runs: a request without a valid
`Authorization: Bearer TOKEN` gets HTTP 401 with `WWW-Authenticate: Bearer realm="volga"` (docs/security.md).
The node side adds the gRPC interceptor for the Agent API and the gateway (`volga_agent.auth`).
"""

from __future__ import annotations

import dataclasses
import hmac
import pathlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import prometheus_client as prom
from aiohttp import web

SCHEME = "bearer"
CHALLENGE = 'Bearer realm="volga"'


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


def rest_middleware(tokens: Tokens, open_prefixes: tuple[str, ...]) -> Any:
    """An aiohttp middleware answering 401 to requests without a valid bearer token, but for `open_prefixes`."""

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path.startswith(open_prefixes) or tokens.accepts(request.headers.get("Authorization")):
            return await handler(request)
        return web.json_response({"error": "a bearer token is required (header 'Authorization: Bearer TOKEN')"},
                                 status=401, headers={"WWW-Authenticate": CHALLENGE})

    return check


def metrics_app(registries: Sequence[prom.CollectorRegistry], tokens: Tokens | None = None) -> web.Application:
    """`GET /metrics`: the series of these registries, in Prometheus' text format; with `tokens`, only for a
    request that carries one of them (`Authorization: Bearer TOKEN`), else 401."""

    async def handle(_: web.Request) -> web.Response:
        body = b"".join(prom.generate_latest(r) for r in registries)
        return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[rest_middleware(tokens, ())] if tokens is not None else [])
    app.router.add_get("/metrics", handle)
    return app


async def listen(http_app: web.Application, host: str, port: int, reuse_port: bool = False,
                 **options: Any) -> tuple[web.AppRunner, int]:
    """Serve an aiohttp app on host:port (0 picks a free port) on the running event loop: its runner (`cleanup()`
    stops it) and the port. With `reuse_port` other processes may listen on the same port (SO_REUSEPORT; the
    kernel spreads connections over them). `options` go to the runner's request handler (e.g. auto_decompress)."""
    runner = web.AppRunner(http_app, access_log=None, handle_signals=False, **options)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None).start()
    return runner, int(runner.addresses[0][1])


async def serve_metrics(registries: Sequence[prom.CollectorRegistry], host: str, port: int,
                        tokens: Tokens | None = None) -> tuple[web.AppRunner, int]:
    """`metrics_app` served on host:port, as `listen`."""
    return await listen(metrics_app(registries, tokens), host, port)
