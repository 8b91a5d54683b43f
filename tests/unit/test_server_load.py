"""A model server's requests in the gateway's per-model load (the load the node's autonomy loop reads): every lease
the proxies take counts as one request (`proxy.Counted`, `Dataplane.served`), over HTTP and gRPC passed through, as
a built-in model's requests count; while the server is shed they are refused before any wake and counted as
shed, unless a neighbour's gateway takes them. The servers here are in-process upstreams (an aiohttp app, a gRPC
servicer), the gateways real ones in this process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from volga_agent import neighbours
from volga_agent.gateway import app, catalog, dataplane, links, proxy
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc
from volga_core import api


def server_spec() -> api.ModelSpecSpec:
    return api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": "/srv",
                                             "server": {"command": ["app", "--port", "{port}", "--grpc",
                                                                    "{grpc_port}"], "protocol": "oip-grpc"}})


@dataclasses.dataclass(frozen=True)
class _Lease:
    base_url: str
    grpc_address: str
    path_prefix: str = "/"
    oip: bool = True


class _Servers:
    """One server, HOT at `base_url` / `grpc_address`; `inside` is set while a lease is held."""

    def __init__(self, base_url: str = "", grpc_address: str = "") -> None:
        self.lease_of = _Lease(base_url, grpc_address)
        self.inside = asyncio.Event()
        self.go_on = asyncio.Event()
        self.go_on.set()
        self.gateways: dict[str, proxy.Remote] = {}  # other nodes' gateways by gRPC address

    def serves(self, model_id: str) -> bool:
        return model_id == "srv"

    def speaks_grpc(self, model_id: str) -> bool:
        return True

    def elsewhere(self, model_id: str) -> proxy.Remote | None:
        return None

    def remote(self, gateway: str, http: str = "") -> proxy.Remote | None:
        return self.gateways.get(gateway)

    @contextlib.asynccontextmanager
    async def lease(self, model_id: str, timeout_sec: float | None) -> AsyncIterator[_Lease]:
        self.inside.set()
        await self.go_on.wait()
        yield self.lease_of


def _plane() -> dataplane.Dataplane:
    return dataplane.Dataplane(catalog.Catalog({"srv": server_spec()}),
                               links.LocalAgentLink(lambda m, h: links.Route("", "")))


def test_a_lease_counts_one_request_from_its_wake_to_its_answer() -> None:
    plane = _plane()
    servers = _Servers("http://127.0.0.1:1")
    counted = proxy.Counted(servers, plane)

    async def main() -> None:
        servers.go_on.clear()  # a wake that takes a while: the request is in the model's queue meanwhile
        held = counted.lease("srv", None)
        entered = asyncio.ensure_future(held.__aenter__())
        await servers.inside.wait()
        during = plane.drain_load()["srv"]
        assert (during.arrivals, during.completed, during.queue_depth) == (1, 0, 1)
        servers.go_on.set()
        await entered
        assert plane.drain_load()["srv"].queue_depth == 1  # answering
        await held.__aexit__(None, None, None)
        with pytest.raises(RuntimeError, match="the exchange failed"):
            async with counted.lease("srv", None):
                raise RuntimeError("the exchange failed")  # counted all the same, as `observe` counts a failure

    asyncio.run(main())
    after = plane.drain_load()["srv"]
    assert (after.arrivals, after.completed, after.queue_depth) == (1, 2, 0)
    assert len(after.latencies_ms) == 2 and all(ms >= 0.0 for ms in after.latencies_ms)


class _Upstream(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)


async def _http_upstream(seen: list[web.Request] | None = None) -> tuple[web.AppRunner, str]:
    """An OIP HTTP server that answers /v2/models/{model}/infer (each request it gets appended to `seen`), and its
    base URL."""
    async def infer(request: web.Request) -> web.Response:
        if seen is not None:
            seen.append(request)
        return web.json_response({"model_name": request.match_info["model"], "outputs": []})

    http_app = web.Application()
    http_app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(http_app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _upstreams() -> tuple[web.AppRunner, grpc.aio.Server, str, str]:
    runner, base_url = await _http_upstream()
    grpc_server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Upstream(), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    return runner, grpc_server, base_url, f"127.0.0.1:{grpc_port}"


def test_the_gateway_counts_a_servers_requests_over_http_and_grpc_in_its_load() -> None:
    async def main() -> dataplane.ModelLoad:
        runner, grpc_server, base_url, grpc_address = await _upstreams()
        gateway = app.Gateway(catalog.Catalog({"srv": server_spec()}),
                              links.LocalAgentLink(lambda m, h: links.Route("", "")),
                              app.Settings(http_port=0, grpc_port=0, metrics_port=0),
                              servers=_Servers(base_url, grpc_address))
        await gateway.start()
        try:
            async with aiohttp.ClientSession() as session:
                for _ in range(2):
                    async with session.post(f"http://127.0.0.1:{gateway.ports['http']}/v2/models/srv/infer",
                                            json={"inputs": []}) as r:
                        assert r.status == 200 and (await r.json())["model_name"] == "srv"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
                answer = await pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    pb.ModelInferRequest(model_name="srv", id="r1"), timeout=10)
                assert answer.id == "r1"
            return gateway.dataplane.drain_load()["srv"]
        finally:
            await gateway.stop(0)
            await grpc_server.stop(0)
            await runner.cleanup()

    load = asyncio.run(main())
    assert (load.arrivals, load.completed, load.queue_depth, load.shed) == (3, 3, 0, 0)
    assert len(load.latencies_ms) == 3 and all(ms > 0.0 for ms in load.latencies_ms)


class _CountingUpstream(_Upstream):
    def __init__(self) -> None:
        self.calls = 0

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        return await super().ModelInfer(request, context)

    async def ModelStreamInfer(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            self.calls += 1
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                                                   id=request.id))


async def _refused_over_grpc(channel: grpc.aio.Channel, retry_after_ms: str) -> None:
    """A ModelInfer for the shed server "srv", and a stream bound to it, each refused RESOURCE_EXHAUSTED with the
    retry hint `retry_after_ms` in its trailer (the stream refused as a whole, as a failed wake ends it)."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ModelInfer(pb.ModelInferRequest(model_name="srv", id="r1"), timeout=10)
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", retry_after_ms) in tuple(refused.value.trailing_metadata() or ())
    stream = stub.ModelStreamInfer(timeout=10)
    await stream.write(pb.ModelInferRequest(model_name="srv", id="s1"))
    await stream.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        assert [answer async for answer in stream] == []
    assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after-ms", retry_after_ms) in tuple(await stream.trailing_metadata() or ())


def test_a_shed_servers_requests_are_refused_before_any_wake_and_counted_as_shed() -> None:
    upstream = _CountingUpstream()
    http_calls: list[web.Request] = []

    async def main() -> tuple[dataplane.ModelLoad, dataplane.ModelLoad, str]:
        runner, base_url = await _http_upstream(http_calls)
        grpc_server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(upstream, grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        servers = _Servers(base_url, f"127.0.0.1:{grpc_port}")
        gateway = app.Gateway(catalog.Catalog({"srv": server_spec()}),
                              links.LocalAgentLink(lambda m, h: links.Route("", "")),
                              app.Settings(http_port=0, grpc_port=0, metrics_port=0), servers=servers)
        await gateway.start()
        url = f"http://127.0.0.1:{gateway.ports['http']}/v2/models/srv/infer"
        try:
            gateway.dataplane.shed("srv", 1500)
            async with aiohttp.ClientSession() as session, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ports['grpc']}") as channel:
                async with session.post(url, json={"inputs": []}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "2"  # 1.5 s, rounded up
                    assert r.content_type == "application/json"
                    assert "srv" in (await r.json())["error"] and "shedding" in (await r.json())["error"]
                await _refused_over_grpc(channel, "1500")
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                assert not servers.inside.is_set() and http_calls == [] and upstream.calls == 0  # never woken
                shed = gateway.dataplane.drain_load()["srv"]

                gateway.dataplane.unshed("srv")
                async with session.post(url, json={"inputs": []}) as r:
                    assert r.status == 200 and (await r.json())["model_name"] == "srv"
                assert (await stub.ModelInfer(pb.ModelInferRequest(model_name="srv", id="r2"), timeout=10)).id == "r2"
                stream = stub.ModelStreamInfer(timeout=10)
                await stream.write(pb.ModelInferRequest(model_name="srv", id="s2"))
                await stream.done_writing()
                assert [answer.infer_response.id async for answer in stream] == ["s2"]
                assert [r.path for r in http_calls] == ["/v2/models/srv/infer"] and upstream.calls == 2
            served = gateway.dataplane.drain_load()["srv"]
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{gateway.ports['metrics']}/metrics") as r:
                return shed, served, await r.text()
        finally:
            await gateway.stop(0)
            await grpc_server.stop(0)
            await runner.cleanup()

    shed, served, scraped = asyncio.run(main())
    # As `observe` counts a shed request: arrived and shed, never in the queue, no completion.
    assert (shed.arrivals, shed.completed, shed.queue_depth, shed.shed, shed.latencies_ms) == (3, 0, 0, 3, ())
    assert (served.arrivals, served.completed, served.queue_depth, served.shed) == (3, 3, 0, 0)
    for line in ('volga_gateway_requests_total{code="RESOURCE_EXHAUSTED",model="srv",protocol="http"} 1.0',
                 'volga_gateway_requests_total{code="RESOURCE_EXHAUSTED",model="srv",protocol="grpc"} 1.0',
                 'volga_gateway_requests_total{code="RESOURCE_EXHAUSTED",model="srv",protocol="grpc-stream"} 1.0',
                 'volga_gateway_shed_requests_total{model="srv"} 3.0'):
        assert line in scraped, [s for s in scraped.splitlines() if "srv" in s]


class _Elsewhere(_Servers):
    """No instance here: every request goes on to the gateway at `remote`."""

    def __init__(self, remote: proxy.Remote) -> None:
        super().__init__()
        self.remote = remote

    def elsewhere(self, model_id: str) -> proxy.Remote | None:
        return self.remote


def test_a_neighbours_shed_reaches_the_client_with_its_retry_hint() -> None:
    """A request passed on to the gateway of the node that runs the server, which sheds it: its refusal comes back
    through this gateway as it was given, the retry hint included (HTTP Retry-After, gRPC trailer retry-after-ms)."""
    upstream = _CountingUpstream()

    async def main() -> None:
        grpc_server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(upstream, grpc_server)
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        settings = app.Settings(http_port=0, grpc_port=0, metrics_port=0)
        no_workers = links.LocalAgentLink(lambda m, h: links.Route("", ""))
        there = app.Gateway(catalog.Catalog({"srv": server_spec()}), no_workers, settings,
                            servers=_Servers("http://127.0.0.1:1", f"127.0.0.1:{grpc_port}"))
        await there.start()
        remote = proxy.Remote(f"http://127.0.0.1:{there.ports['http']}", f"127.0.0.1:{there.ports['grpc']}")
        here = app.Gateway(catalog.Catalog({"srv": server_spec()}), no_workers, settings,
                           servers=_Elsewhere(remote))
        await here.start()
        try:
            there.dataplane.shed("srv", 2500)
            async with aiohttp.ClientSession() as session, \
                    session.post(f"http://127.0.0.1:{here.ports['http']}/v2/models/srv/infer",
                                 json={"inputs": []}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "3"
                assert "shedding" in (await r.json())["error"]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{here.ports['grpc']}") as channel:
                await _refused_over_grpc(channel, "2500")
            assert upstream.calls == 0 and there.dataplane.drain_load()["srv"].shed == 3
        finally:
            await here.stop(0)
            await there.stop(0)
            await grpc_server.stop(0)

    asyncio.run(main())


def test_an_overloaded_nodes_server_requests_go_to_a_neighbour_that_takes_them() -> None:
    """Node a sheds its server; node b, its neighbour, has it and takes a's requests (over HTTP, gRPC and a stream,
    marked forwarded), which count as shed in a's load and as passed on to b. Once b sheds it too, a call b declines
    (a's view of b not yet fresh) is refused with a's retry hint, and with b's level saying so nothing is offered to
    it: a refuses calls and streams itself, never waking its server. A node that is only overloaded (not shedding
    the server) serves the request itself when its neighbour cannot be reached."""
    upstream_a, upstream_b = _CountingUpstream(), _CountingUpstream()
    http_calls: list[web.Request] = []

    async def main() -> tuple[dataplane.ModelLoad, str]:
        runner, base_url = await _http_upstream(http_calls)
        servers_a = []
        gateways = []
        settings = app.Settings(http_port=0, grpc_port=0, metrics_port=0)
        no_workers = links.LocalAgentLink(lambda m, h: links.Route("", ""))
        grpc_servers = []
        for upstream in (upstream_a, upstream_b):
            grpc_server = grpc.aio.server()
            pb_grpc.add_GRPCInferenceServiceServicer_to_server(upstream, grpc_server)
            port = grpc_server.add_insecure_port("127.0.0.1:0")
            await grpc_server.start()
            grpc_servers.append(grpc_server)
            servers_a.append(_Servers(base_url, f"127.0.0.1:{port}"))
        for node, servers in zip("ab", servers_a, strict=True):
            gateway = app.Gateway(catalog.Catalog({"srv": server_spec()}), no_workers,
                                  dataclasses.replace(settings, node=node), servers=servers)
            await gateway.start()
            gateways.append(gateway)
        a, b = gateways
        b_address = f"127.0.0.1:{b.ports['grpc']}"
        servers_a[0].gateways[b_address] = proxy.Remote(f"http://127.0.0.1:{b.ports['http']}", b_address)

        def heard(state: str = "ACCEPT", b_sheds: bool = False) -> None:  # fresh before each request (stale after 1 s)
            level_b = neighbours.Level("b", "ACCEPT", models=(neighbours.ModelLevel("srv", hot=True, shed=b_sheds),),
                                       gateway=b_address)
            a.dataplane.set_neighbours(state, (neighbours.Heard(level_b, time.monotonic()),))

        try:
            a.dataplane.shed("srv", 900)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{a.ports['grpc']}") as channel, \
                    aiohttp.ClientSession() as session:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                heard()
                assert (await stub.ModelInfer(pb.ModelInferRequest(model_name="srv", id="r1"), timeout=10)).id == "r1"
                heard()
                async with session.post(f"http://127.0.0.1:{a.ports['http']}/v2/models/srv/infer",
                                        json={"inputs": []}) as r:
                    assert r.status == 200 and (await r.json())["model_name"] == "srv"
                heard()
                stream = stub.ModelStreamInfer(timeout=10)
                for request_id in ("s1", "s2"):
                    await stream.write(pb.ModelInferRequest(model_name="srv", id=request_id))
                await stream.done_writing()
                assert [answer.infer_response.id async for answer in stream] == ["s1", "s2"]
                # b's server answered all three, the HTTP request marked forwarded; a's never woke
                assert upstream_a.calls == 0 and upstream_b.calls == 3
                assert [r.headers.get(links.FORWARDED) for r in http_calls] == ["1"]
                assert not servers_a[0].inside.is_set()
                passed = a.dataplane.drain_load()["srv"]

                b.dataplane.shed("srv", 4000)  # b declines the call: a refuses it with its own hint
                heard()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ModelInfer(pb.ModelInferRequest(model_name="srv", id="r2"), timeout=10)
                assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert ("retry-after-ms", "900") in tuple(refused.value.trailing_metadata() or ())
                heard(b_sheds=True)  # b says it sheds it: nothing goes there, a refuses calls and streams itself
                await _refused_over_grpc(channel, "900")
                assert upstream_a.calls == 0 and upstream_b.calls == 3 and not servers_a[0].inside.is_set()

                a.dataplane.unshed("srv")  # a only overloaded, b out of reach: a serves the call itself
                b_gone = f"127.0.0.1:{b.ports['grpc']}"
                await b.stop(0)
                gateways.remove(b)
                servers_a[0].gateways[b_gone] = proxy.Remote("http://127.0.0.1:1", b_gone)
                heard(neighbours.OVERLOADED)
                assert (await stub.ModelInfer(pb.ModelInferRequest(model_name="srv", id="r3"), timeout=10)).id == "r3"
                assert upstream_a.calls == 1
            async with aiohttp.ClientSession() as session, \
                    session.get(f"http://127.0.0.1:{a.ports['metrics']}/metrics") as r:
                return passed, await r.text()
        finally:
            for gateway in gateways:
                await gateway.stop(0)
            for grpc_server in grpc_servers:
                await grpc_server.stop(0)
            await runner.cleanup()

    passed, scraped = asyncio.run(main())
    # The call, the HTTP request and the stream passed on: arrived and shed here, never in a's queue, no completion.
    assert (passed.arrivals, passed.completed, passed.queue_depth, passed.shed) == (3, 0, 0, 3)
    assert 'volga_gateway_neighbour_forwards_total{model="srv",target="b"} 3.0' in scraped, \
        [s for s in scraped.splitlines() if "neighbour" in s]


def test_a_servers_answer_that_breaks_off_reaches_the_client_broken() -> None:
    """A server that sends the head and part of an answer and then drops its connection: the gateway cuts the
    client's connection too, so the client sees an answer that ended early (as it would from the server itself),
    not a complete one or one that never ends."""
    async def main() -> None:
        async def infer(request: web.Request) -> web.StreamResponse:
            answer = web.StreamResponse()
            answer.enable_chunked_encoding()
            await answer.prepare(request)
            await answer.write(b"part")
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return answer

        http_app = web.Application()
        http_app.router.add_post("/v2/models/{model}/infer", infer)
        runner = web.AppRunner(http_app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        gateway = app.Gateway(catalog.Catalog({"srv": server_spec()}),
                              links.LocalAgentLink(lambda m, h: links.Route("", "")),
                              app.Settings(http_port=0, grpc_port=0, metrics_port=0),
                              servers=_Servers(f"http://127.0.0.1:{runner.addresses[0][1]}", "127.0.0.1:1"))
        await gateway.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session, \
                    session.post(f"http://127.0.0.1:{gateway.ports['http']}/v2/models/srv/infer", json={}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
        finally:
            await gateway.stop(0)
            await runner.cleanup()

    asyncio.run(main())
