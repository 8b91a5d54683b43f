"""The gateway's REST adapter: the Open Inference Protocol's HTTP routes (what tritonclient.http calls).

Each handler decodes its request with `oip`, asks the dataplane and encodes the answer; an `oip.OipError`
becomes its HTTP status with a JSON `error` body. Nothing here decides anything (`docs/architecture.md`).

Requests that name a model server (`framework: server`) are proxied to it (`proxy`), before any OIP handler.

Bodies arrive as sent: the server runs without aiohttp's automatic decompression (`RUNNER_OPTIONS`), so a
gzip or deflate body is checked and decompressed here (`oip.decode_content`), within the body size limit. Every
handler answers anything unexpected with a short 500, and a client that goes away is logged in one line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from volga_agent import auth
from volga_agent.gateway import dataplane, oip, proxy

log = logging.getLogger(__name__)
# How the REST server's runner is set up: bodies are decompressed by `oip.decode_content`, not by aiohttp.
RUNNER_OPTIONS: dict[str, Any] = {"auto_decompress": False}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Health checks answer without a token (auth.rest_middleware), so probes need none.
OPEN_PREFIXES = ("/v2/health/",)


def _error(exc: oip.OipError) -> web.Response:
    """The error's status and JSON body; a refusal that says when to retry (a shed model) adds Retry-After, in
    whole seconds rounded up."""
    return web.Response(status=exc.http_status, body=oip.rest_error_body(exc), content_type="application/json",
                        headers=oip.retry_after_header(exc))


def _model(request: web.Request, headers: dict[str, str] | None = None) -> str:
    if headers is None:
        headers = dataplane.headers(request.headers.items())
    return dataplane.model_id(headers, request.match_info["model"])


def _version(request: web.Request) -> str:
    """The version a `/v2/models/{model}/versions/{version}/...` path names ("" for the plain path)."""
    return request.match_info.get("version", "")


def _last_resort(handler: Handler) -> Handler:
    """The handler, with anything it did not expect answered by a short 500 (logged once with its traceback)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except ConnectionResetError as exc:
            log.info("%s %s: the client went away: %s", request.method, request.path, exc)
            return web.Response(status=499)
        except Exception as exc:
            log.exception("%s %s failed unexpectedly", request.method, request.path)
            return _error(oip.error("INTERNAL", f"internal error: {type(exc).__name__}: {str(exc)[:200]}"))

    return guarded


async def _body(request: web.Request, plane: dataplane.Dataplane, headers: dict[str, str]) -> bytes:
    """The request body, decompressed as its Content-Encoding says."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise oip.error("RESOURCE_EXHAUSTED", f"request body over {plane.max_request_bytes} bytes") from None
    except ConnectionResetError as exc:  # the client went away while sending
        raise oip.error("CANCELLED", f"the client went away while sending the body: {exc}") from None
    encoding = headers.get("content-encoding")
    if encoding is None:
        return body
    return await dataplane.off_loop(len(body), oip.decode_content, body, encoding, plane.max_request_bytes)


# A server's HTTP status -> the gRPC status name its count is labelled with (502 from an upstream that did not answer;
# 429 from a shed server's refusal, or from the server's own).
_STATUS_NAMES = {**{status: name for name, status in reversed(oip.HTTP_STATUS.items())}, 502: "UNAVAILABLE",
                 429: "RESOURCE_EXHAUSTED"}


def _to_servers(servers: proxy.Servers, plane: dataplane.Dataplane) -> Any:
    """A middleware that proxies every request naming a model server (`proxy`), whatever its path; each is counted
    in `volga_gateway_requests` (protocol http; code OK for an answer under 400, else the gRPC status name of its
    HTTP status) and an OK one's time, wake included, in `volga_gateway_request_latency_ms`."""

    @web.middleware
    async def route(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            model = proxy.model_of(request)
        except oip.OipError:
            return await handler(request)  # the OIP handlers answer it
        if model and servers.serves(model):
            start = time.perf_counter()
            response = await proxy.forward(request, servers, model, plane.max_request_bytes)
            code = "OK" if response.status < 400 else _STATUS_NAMES.get(response.status, "UNKNOWN")
            plane.metrics.requests.labels(model, "http", code).inc()
            if code == "OK":
                plane.metrics.latency.labels(model, "http").observe((time.perf_counter() - start) * 1e3)
            return response
        return await handler(request)

    return route


def app(plane: dataplane.Dataplane, tokens: auth.Tokens | None = None,
        servers: proxy.Servers | None = None) -> web.Application:
    async def live(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(_: web.Request) -> web.Response:
        if plane.catalog.loaded:
            return web.Response(status=200)
        return web.Response(status=503, text="the model catalog is not loaded yet (the API server has not answered "
                                             "its first lists)")

    async def server_metadata(_: web.Request) -> web.Response:
        return web.json_response({"name": dataplane.SERVER_NAME, "version": dataplane.SERVER_VERSION,
                                  "extensions": list(dataplane.EXTENSIONS)})

    async def model_ready(request: web.Request) -> web.Response:
        try:
            ready = await plane.model_ready(_model(request), _version(request))
        except oip.OipError as exc:
            return _error(exc)
        return web.Response(status=200 if ready else 400)

    async def model_metadata(request: web.Request) -> web.Response:
        try:
            m = await plane.model_metadata(_model(request), _version(request))
        except oip.OipError as exc:
            return _error(exc)
        return web.json_response(oip.model_metadata_rest(m.name, m.versions, m.platform, m.inputs, m.outputs))

    async def model_config(request: web.Request) -> web.Response:
        try:
            c = await plane.model_config(_model(request), _version(request))
        except oip.OipError as exc:
            return _error(exc)
        return web.json_response(dataplane.config_rest(c))

    async def repository_index(_: web.Request) -> web.Response:
        return web.json_response([{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason}
                                  for m in await plane.repository_index()])

    async def infer(request: web.Request) -> web.Response:
        headers = dataplane.headers(request.headers.items())
        try:
            model = _model(request, headers)
        except oip.OipError as exc:
            return _error(exc)

        async def call() -> web.Response:
            body = await _body(request, plane, headers)
            length = oip.rest_header_length(headers.get("inference-header-content-length"))
            # A large JSON body is decoded in a thread, parsing numbers in Python so the loop gets the GIL.
            decoded = await dataplane.off_loop(len(body), oip.decode_rest_request, body, length,
                                               yielding=len(body) >= dataplane.OFF_LOOP_BYTES)
            spec, outputs = await plane.infer(model, headers, decoded.inputs, version=_version(request))
            size = sum(v.nbytes for v in outputs.values())
            payload, json_length = await dataplane.off_loop(
                size, oip.encode_rest_response, spec.model_id, spec.version, decoded.request_id, outputs,
                decoded.outputs, decoded.binary_default)
            if json_length is None:
                return web.Response(body=payload, headers={"Content-Type": "application/json"})
            return web.Response(body=payload, headers={"Content-Type": "application/octet-stream",
                                                       "Inference-Header-Content-Length": str(json_length)})

        try:
            return await plane.observe(model, "http", call)
        except oip.OipError as exc:
            return _error(exc)

    middlewares = [auth.rest_middleware(tokens, OPEN_PREFIXES)] if tokens is not None else []
    if servers is not None:
        middlewares.append(_to_servers(servers, plane))
    web_app = web.Application(client_max_size=plane.max_request_bytes, middlewares=middlewares)
    routes: list[tuple[str, str, Handler]] = [
        ("GET", "/v2/health/live", live), ("GET", "/v2/health/ready", ready), ("GET", "/v2", server_metadata),
        ("POST", "/v2/repository/index", repository_index)]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [("GET", prefix, model_metadata), ("GET", f"{prefix}/ready", model_ready),
                   ("GET", f"{prefix}/config", model_config), ("POST", f"{prefix}/infer", infer)]
    for method, path, handler in routes:
        web_app.router.add_route(method, path, _last_resort(handler))
    return web_app
