"""A model server's requests in the gateway's per-model load (the load the node's autonomy loop reads): every lease
the proxies take counts as one request (`proxy.Counted`, `Dataplane.served`), over HTTP and gRPC passed through, as
a built-in model's requests count. The servers here are in-process upstreams (an aiohttp app, a gRPC servicer)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

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

    def serves(self, model_id: str) -> bool:
        return model_id == "srv"

    def speaks_grpc(self, model_id: str) -> bool:
        return True

    def elsewhere(self, model_id: str) -> proxy.Remote | None:
        return None

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
    counted = proxy.Counted(servers, plane.served)

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


async def _upstreams() -> tuple[web.AppRunner, grpc.aio.Server, str, str]:
    async def infer(request: web.Request) -> web.Response:
        return web.json_response({"model_name": request.match_info["model"], "outputs": []})

    http_app = web.Application()
    http_app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(http_app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    grpc_server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Upstream(), grpc_server)
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    return runner, grpc_server, f"http://127.0.0.1:{runner.addresses[0][1]}", f"127.0.0.1:{grpc_port}"


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
