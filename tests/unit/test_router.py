"""Routing cache and single-flight activation, with a fake agent link."""

from __future__ import annotations

import asyncio

import pytest

from volga_agent import errors
from volga_agent.gateway import links, router


class FakeLink:
    def __init__(self, delay: float = 0.05, fail: Exception | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.delay = delay
        self.fail = fail

    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> links.Route:
        self.calls.append((model_id, device_hint))
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return links.Route(f"{model_id}-0", f"/tmp/{model_id}{'-' + device_hint if device_hint else ''}.sock")

    async def close(self) -> None:
        pass


def test_concurrent_requests_share_one_activation() -> None:
    async def main() -> None:
        link = FakeLink()
        r = router.Router(link, ttl_sec=60)
        routes = await asyncio.gather(*(r.route("m") for _ in range(200)))
        assert link.calls == [("m", "")]
        assert {x.socket for x in routes} == {"/tmp/m.sock"}
        await r.route("m")
        assert len(link.calls) == 1
        sample = r.metrics.registry.get_sample_value
        assert sample("volga_gateway_route_cache_total", {"result": "hit"}) == 1
        assert sample("volga_gateway_route_cache_total", {"result": "miss"}) == 200
        assert sample("volga_gateway_activations_total", {"model": "m"}) == 1

    asyncio.run(main())


def test_device_hints_are_routed_separately() -> None:
    async def main() -> None:
        link = FakeLink()
        r = router.Router(link)
        a, b = await asyncio.gather(r.route("m", "cuda:0"), r.route("m", "cuda:1"))
        assert (a.socket, b.socket) == ("/tmp/m-cuda:0.sock", "/tmp/m-cuda:1.sock")
        assert sorted(link.calls) == [("m", "cuda:0"), ("m", "cuda:1")]

    asyncio.run(main())


def test_ttl_and_invalidate() -> None:
    async def main() -> None:
        link = FakeLink(delay=0)
        r = router.Router(link, ttl_sec=0.05)
        await r.route("m")
        await asyncio.sleep(0.08)
        await r.route("m")
        assert len(link.calls) == 2
        r.invalidate("m")
        await r.route("m")
        assert len(link.calls) == 3

    asyncio.run(main())


def test_errors_reach_every_waiter_and_are_not_cached() -> None:
    async def main() -> None:
        link = FakeLink(fail=errors.UnknownModel("nope"))
        r = router.Router(link)
        results = await asyncio.gather(*(r.route("m") for _ in range(5)), return_exceptions=True)
        assert all(isinstance(x, errors.UnknownModel) for x in results)
        with pytest.raises(errors.UnknownModel):
            await r.route("m")
        assert len(link.calls) == 2

    asyncio.run(main())


def test_a_caller_giving_up_does_not_cancel_the_wake() -> None:
    async def main() -> None:
        link = FakeLink(delay=0.1)
        r = router.Router(link)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.route("m"), 0.01)
        route = await r.route("m")  # joins the same activation, still running
        assert route.instance == "m-0" and len(link.calls) == 1

    asyncio.run(main())


def test_catalog_knows_where_models_are_placed() -> None:
    from volga_agent.gateway import catalog as gateway_catalog
    from volga_agent.gateway import oip
    from volga_core import api

    spec = api.ModelSpecSpec.model_validate({
        "modelId": "m", "framework": "onnx", "source": "/m.onnx",
        "inputs": [{"name": "x", "dtype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "dtype": "FP32", "shape": [-1, 1]}]})
    catalog = gateway_catalog.Catalog({"m": spec})
    assert catalog.ready("m", "node-a") and not catalog.ready("other", "node-a")
    catalog.require_local("m", "node-a")  # placements unknown (embedded mode): nothing to check
    catalog.set_placements({"m": [gateway_catalog.Placement("m-0", "node-b", "FROZEN", True)]})
    assert not catalog.ready("m", "node-a") and catalog.ready("m", "node-b")
    with pytest.raises(oip.OipError, match="no instance on node node-a: its instances are on node-b") as err:
        catalog.require_local("m", "node-a")
    assert (err.value.code, err.value.http_status) == ("UNAVAILABLE", 503)
    catalog.set_placements({"m": [gateway_catalog.Placement("m-0", "node-a", "FROZEN", False)]})
    catalog.require_local("m", "node-a")
    assert not catalog.ready("m", "node-a")  # placed here, not Ready yet


def test_remote_gateways_prefer_ready_hot_instances() -> None:
    from volga_agent.gateway import catalog as gateway_catalog

    catalog = gateway_catalog.Catalog()
    P = gateway_catalog.Placement
    catalog.set_placements({"m": [
        P("m-0", "node-a", "HOT", True, "a:8001"), P("m-1", "node-b", "FROZEN", True, "b:8001"),
        P("m-2", "node-c", "HOT", True, "c:8001"), P("m-3", "node-d", "HOT", False, "d:8001"),
        P("m-4", "node-e", "HOT", True, "")]})
    assert catalog.remote_gateways("m", "node-a") == ["c:8001", "b:8001", "d:8001"]
    assert catalog.remote_gateways("other", "node-a") == []


def test_made_up_device_hints_do_not_grow_the_cache() -> None:
    async def main() -> None:
        link = FakeLink(delay=0)
        r = router.Router(link, max_routes=8)
        for i in range(100):
            await r.route("m", f"hint-{i}")
        assert r.cached() == 8
        first = len(link.calls)
        await r.route("m", "hint-99")  # among the most recent: still cached
        assert len(link.calls) == first
        await r.route("m", "hint-0")  # evicted long ago: activates again
        assert len(link.calls) == first + 1 and r.cached() == 8
        # A hit refreshes a route's place: after 7 new hints, hint-0 (used just now) is still there.
        await r.route("m", "hint-0")
        for i in range(100, 107):
            await r.route("m", f"hint-{i}")
        calls = len(link.calls)
        await r.route("m", "hint-0")
        assert len(link.calls) == calls

    asyncio.run(main())
