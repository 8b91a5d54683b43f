"""The gateway's path to model servers (`framework: server`): HTTP requests proxied to the server a request names.

The model is `x-model-id`, or for the Open Inference Protocol's routes the model in the URL
(`/v2/models/{model}/...`; both given and different is the client's error, as for Volga's own models). The first
request to a FROZEN server wakes it (`Servers.lease`, single-flight on the node side); the server is kept from being
frozen until the answer has been passed on. OIP HTTP requests are passed through as they are; plain HTTP is
forwarded under the server's path prefix only. An answer is streamed back chunk by chunk as the server writes it,
so server-sent events and chunked answers stay streaming.

In a cluster the servers run in the node's agent: `AgentServers` leases one through the Agent API (Hold wakes it and
keeps it from being frozen for as long as the call is open; the gateway ends the call once the answer is passed on,
and a gateway that dies mid-request ends it with its connection), and the server listens where Hold says. A request
for a server this node has no instance of is passed on, once, to the gateway of a node that has one (`elsewhere`:
the addresses its EMI reports, `gatewayHttp` for HTTP; where that is not reported, its host on this gateway's own
HTTP port, the chart's way), marked `x-volga-forwarded` so that it is never passed on again. Under `volga up` the
agent's pool is in the gateway's process: `PoolLink` is the same link over it, and the other gateway processes lease
through the Agent API as in a cluster.

Bounds as for every model: the body is read up to the gateway's request limit (413 above it), and `x-timeout-ms`
bounds the wake and the whole exchange (504 when it passes). Each exchange opens its own connection to the server
and closes it: a connection left open would be one more socket in the server's image. The gateway counts each
request served here in its model's load for the node's autonomy loop (`Counted`), over both protocols. A request of
an overloaded node (the loop sheds the server, or the node is in EMERGENCY) goes first to the neighbour that takes a
shed model's (`Counted.neighbour`), marked forwarded; while the loop sheds the server and no neighbour takes them,
its requests are refused at once, before any wake, as a shed model's are: 429 with the JSON error body of the REST
path and Retry-After (whole seconds, rounded up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol

import aiohttp
from aiohttp import web

from volga_agent import errors
from volga_agent.gateway import catalog, dataplane, links, oip
from volga_core import api

log = logging.getLogger(__name__)

_OIP_MODEL = re.compile(r"^/v2/models/([^/]+)(/|$)")
# Headers that belong to one connection (RFC 9110 7.6.1) and are not forwarded; the body's length is set again.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"})


class Lease(Protocol):
    """A HOT server that stays HOT until released."""

    @property
    def base_url(self) -> str: ...  # http://127.0.0.1:PORT or unix:PATH

    @property
    def path_prefix(self) -> str: ...

    @property
    def oip(self) -> bool: ...

    @property
    def grpc_address(self) -> str: ...  # an oip-grpc server's gRPC (127.0.0.1:PORT); "" for the others


class Servers(Protocol):
    """The node side: which model ids are servers, and a lease on one (waking it when needed)."""

    def serves(self, model_id: str) -> bool: ...

    def speaks_grpc(self, model_id: str) -> bool: ...  # protocol: oip-grpc

    def elsewhere(self, model_id: str) -> Remote | None: ...  # another node's gateway, when this node has none

    def remote(self, gateway: str, http: str = "") -> Remote | None: ...  # another node's gateway: gRPC, HTTP

    def lease(self, model_id: str, timeout_sec: float | None) -> contextlib.AbstractAsyncContextManager[Lease]: ...


@dataclasses.dataclass(frozen=True)
class Remote:
    """Another node's gateway, for a model server this node has no instance of."""

    base_url: str  # http://HOST:PORT
    grpc_address: str  # HOST:PORT
    path_prefix: str = "/"  # that gateway checks it
    oip: bool = True


@dataclasses.dataclass(frozen=True)
class AgentLease:
    """A server the node's agent woke, where it listens."""

    base_url: str
    path_prefix: str
    oip: bool
    grpc_address: str


class AgentLink(Protocol):
    def hold(self, model_id: str, timeout_ms: int) -> contextlib.AbstractAsyncContextManager[links.Route]:
        """The model's server woken and kept from being frozen until the block is left."""
        ...


class PoolLink:
    """A node's pool in this process (`volga up`) as `AgentServers`' link: `hold(model_id)` is
    `activate(model_id)` (blocking: run in a thread), then `release(instance)` once the block is left. An
    activation whose caller stopped waiting (its deadline passed, its client went away) while the wake went on
    is released once the wake is done: unreleased, it would keep the server from its idle freeze."""

    def __init__(self, activate: Callable[[str], links.Route], release: Callable[[str], None]) -> None:
        self._activate = activate
        self._release = release

    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> links.Route:
        wake = asyncio.ensure_future(asyncio.to_thread(self._activate, model_id))
        try:
            return await asyncio.shield(wake)
        except asyncio.CancelledError:
            wake.add_done_callback(self._given_up)
            raise

    def _given_up(self, wake: asyncio.Future[links.Route]) -> None:
        if wake.cancelled() or wake.exception() is not None:
            return
        route = wake.result()
        try:
            self._release(route.instance)
        except errors.UnknownModel as exc:  # removed meanwhile
            log.warning("%s: could not release it: %s", route.instance, exc)

    async def release(self, instance: str) -> None:
        try:
            await asyncio.to_thread(self._release, instance)
        except errors.UnknownModel as exc:
            raise ConnectionError(str(exc)) from None

    @contextlib.asynccontextmanager
    async def hold(self, model_id: str, timeout_ms: int) -> AsyncIterator[links.Route]:
        route = await self.activate(model_id, "", timeout_ms)
        try:
            yield route
        finally:
            try:
                await self.release(route.instance)
            except ConnectionError as exc:
                log.warning("%s: could not release %s: %s", model_id, route.instance, exc)


class Counted:
    """`servers` whose every lease counts as one request of its model in the gateway's per-model load
    (`Dataplane.served`), the load the node's autonomy loop reads, as a built-in model's requests count: both
    proxies (HTTP here, gRPC in `grpc_proxy`) hold a lease from before a request's wake until its answer's last
    byte is passed on, so its arrival, its time in the model's queue, its completion and its latency (the wake
    included) are the request's. A request passed on to another node's gateway takes no lease here: that node
    counts it. The lease may refuse the request instead, before the wake (a shed server: `Dataplane.served` with
    `sheddable`): it raises its `oip.OipError` (`batcher.Overloaded`, with the retry hint), which the proxies
    answer with its status (HTTP 429 with Retry-After; RESOURCE_EXHAUSTED with trailer retry-after-ms).

    Before that, a request of an overloaded node (its server shed, or the node OVERLOADED) goes to the neighbour
    that takes a shed built-in model's request (`neighbour`: `Dataplane.neighbour_for`), marked forwarded; once
    that neighbour has taken it, it counts as passed on (`passed_on`). One that does not take it (it refuses,
    is unavailable or cannot be reached) leaves the request to this node: served, or refused if shed. A stream
    is offered only while the server is shed here (`shed_only`): it cannot come back once its requests went out."""

    def __init__(self, servers: Servers, plane: dataplane.Dataplane) -> None:
        self.servers = servers
        self.plane = plane

    def serves(self, model_id: str) -> bool:
        return self.servers.serves(model_id)

    def speaks_grpc(self, model_id: str) -> bool:
        return self.servers.speaks_grpc(model_id)

    def elsewhere(self, model_id: str) -> Remote | None:
        return self.servers.elsewhere(model_id)

    def remote(self, gateway: str, http: str = "") -> Remote | None:
        return self.servers.remote(gateway, http)

    def neighbour(self, model_id: str, shed_only: bool = False) -> tuple[Remote, str] | None:
        """The gateway of the neighbour (and its node's name) that takes a request of this overloaded node for
        `model_id` (with `shed_only`, only while this node sheds the server: a request this node would refuse
        anyway); None: this node serves the request, or refuses it if the server is shed."""
        if shed_only and not self.plane.sheds(model_id):
            return None
        level = self.plane.neighbour_for(model_id)
        if level is None:
            return None
        remote = self.servers.remote(level.gateway, level.gateway_http)
        return None if remote is None else (remote, level.node)

    def passed_on(self, model_id: str, node: str) -> None:
        self.plane.passed_on(model_id, node)

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, timeout_sec: float | None) -> AsyncIterator[Lease]:
        with self.plane.served(model_id, sheddable=True):
            async with self.servers.lease(model_id, timeout_sec) as lease:
                yield lease


class AgentServers:
    """The model servers of a cluster (the ModelSpecs in the gateway's catalog with `framework: server`), run by
    this node's agent and leased through its Agent API."""

    def __init__(self, models: catalog.Catalog, link: AgentLink, node: str = "") -> None:
        self.models = models
        self.link = link
        self.node = node
        self.http_port = 0  # this gateway's, once it listens: the other gateways' too

    def elsewhere(self, model_id: str) -> Remote | None:
        here = self.models.local(model_id, self.node)
        others = self.models.remote_placements(model_id, self.node) if here == () else []
        # None: served here (or nowhere: the agent says so)
        return self.remote(others[0].gateway, others[0].gateway_http) if others else None

    def remote(self, gateway: str, http: str = "") -> Remote | None:
        """The gateway at `gateway` (gRPC host:port) and `http` (its HTTP host:port, as its agent reports it;
        where it does not, the chart's way: the same host on this gateway's own HTTP port)."""
        if http:
            return Remote(f"http://{http}", gateway)
        if not self.http_port:
            return None
        return Remote(f"http://{gateway.rpartition(':')[0]}:{self.http_port}", gateway)

    def serves(self, model_id: str) -> bool:
        return self.models.known(model_id) and self.models.get(model_id).framework is api.Framework.SERVER

    def speaks_grpc(self, model_id: str) -> bool:
        server = self.models.get(model_id).server
        return server is not None and server.protocol is api.Protocol.OIP_GRPC

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, timeout_sec: float | None) -> AsyncIterator[AgentLease]:
        server = self.models.get(model_id).server
        assert server is not None
        async with self.link.hold(model_id, max(1, round(timeout_sec * 1e3)) if timeout_sec else 0) as route:
            base_url, grpc_address = api.split_address(route.socket)
            yield AgentLease(base_url, server.path_prefix, server.protocol is not api.Protocol.HTTP, grpc_address)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _forwarded(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k: v for k, v in pairs if k.lower() not in _HOP}


def model_of(request: web.Request) -> str:
    """The model a request names (OipError when the header and the URL disagree); "" when it names none."""
    found = _OIP_MODEL.match(request.path)
    return dataplane.model_id(dataplane.headers(request.headers.items()), found.group(1) if found else "")


async def forward(request: web.Request, servers: Servers, model: str, max_request_bytes: int) -> web.StreamResponse:
    """Proxy `request` to the server of `model`, streaming its answer back."""
    timeout_ms = request.headers.get("x-timeout-ms")
    try:
        deadline = time.monotonic() + int(timeout_ms) / 1000 if timeout_ms else None
    except ValueError:
        return _error(400, f"x-timeout-ms {timeout_ms!r} is not a whole number of milliseconds")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"request body over {max_request_bytes} bytes")
    forwarded = bool(request.headers.get(links.FORWARDED))
    remote = None if forwarded else servers.elsewhere(model)
    counted = servers if isinstance(servers, Counted) and not forwarded and remote is None else None
    neighbour = counted.neighbour(model) if counted is not None else None
    try:
        async with asyncio.timeout_at(None if deadline is None else _loop_time(deadline)):
            if remote is not None:
                return await _exchange(request, remote, body, {links.FORWARDED: "1"})
            if neighbour is not None and counted is not None:
                taken = await _relay(request, neighbour[0], body, {links.FORWARDED: "1"}, offered=True)
                if taken is not None:
                    counted.passed_on(model, neighbour[1])
                    return taken
                log.info("%s: neighbour %s did not take the request: served here", model, neighbour[1])
            async with servers.lease(model, None if deadline is None else deadline - time.monotonic()) as lease:
                if not lease.oip and not request.path.startswith(lease.path_prefix):
                    return _error(404, f"{model} serves paths under {lease.path_prefix}, not {request.path}")
                return await _exchange(request, lease, body)
    except TimeoutError:
        return _error(504, f"{model}: no answer within x-timeout-ms {timeout_ms} (waking and answering)")
    except errors.UnknownModel as exc:
        return _error(404, str(exc))
    except errors.ActivationFailed as exc:
        return _error(503, str(exc))
    except oip.OipError as exc:  # refused before its wake (a shed server: `Counted`)
        return web.Response(status=exc.http_status, body=oip.rest_error_body(exc), content_type="application/json",
                            headers=oip.retry_after_header(exc))


def _loop_time(deadline: float) -> float:
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


async def _exchange(request: web.Request, lease: Lease, body: bytes,
                    extra_headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = await _relay(request, lease, body, extra_headers)
    assert response is not None  # only an offer is declined
    return response


# What a neighbour answers when it does not take a request offered to it: shed there too, or unavailable.
_DECLINED = frozenset({429, 502, 503})


async def _relay(request: web.Request, lease: Lease, body: bytes, extra_headers: dict[str, str] | None = None,
                 offered: bool = False) -> web.StreamResponse | None:
    """Send `request` on to `lease` and stream its answer back. With `offered` (a neighbour's gateway offered the
    request of an overloaded node), None when it declines before answering: it cannot be reached, or answers with
    a status of `_DECLINED`."""
    if lease.base_url.startswith("unix:"):
        connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=lease.base_url[len("unix:"):],
                                                                 force_close=True)
        base = "http://localhost"
    else:
        connector, base = aiohttp.TCPConnector(force_close=True), lease.base_url
    started = False  # the answer's head is on its way to the client
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        try:
            upstream_cm = session.request(request.method, base + request.path_qs, data=body or None,
                                          headers={**_forwarded(request.headers.items()), **(extra_headers or {})},
                                          allow_redirects=False)
            async with upstream_cm as upstream:
                if offered and upstream.status in _DECLINED:
                    return None
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                              headers=_forwarded(upstream.headers.items()))
                if upstream.headers.get("content-length") is None:
                    response.enable_chunked_encoding()
                else:
                    response.content_length = int(upstream.headers["content-length"])
                await response.prepare(request)
                started = True
                async for chunk in _chunks(upstream):
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            if started:  # its head and part of it went out: the client's connection is cut, so it sees the break
                log.warning("%s %s: the server's answer broke off: %s", request.method, request.path, exc)
                if request.transport is not None:
                    request.transport.close()
                return response
            if offered:
                return None
            return _error(502, f"the server did not answer: {exc}")


async def _chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    async for chunk in upstream.content.iter_any():
        yield chunk


def app(servers: Servers, max_request_bytes: int = 64 * 2**20) -> web.Application:
    """An aiohttp application that proxies every request naming a server (404 for anything else)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            model = model_of(request)
        except oip.OipError as exc:
            return _error(exc.http_status, str(exc))
        if not model:
            return _error(400, "name the model: an x-model-id header (or /v2/models/{model}/... for OIP)")
        if not servers.serves(model):
            return _error(404, f"{model!r} is not a model server this gateway knows")
        return await forward(request, servers, model, max_request_bytes)

    web_app = web.Application(client_max_size=max_request_bytes)
    web_app.router.add_route("*", "/{tail:.*}", handle)
    return web_app
