"""A model server's lease under `volga up`: the gateway's link to the pool in its process (`proxy.PoolLink`) gives back
an activation its caller stopped waiting for, and a wake shared by concurrent activations is counted once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import threading

import pools
import pytest

from volga_agent import errors, metrics
from volga_agent.gateway import links, proxy
from volga_agent.node import instance, serverpool
from volga_agent.node.settings import Settings
from volga_core import api


def test_an_activation_whose_caller_gave_up_is_released_once_woken() -> None:
    woken, released = threading.Event(), []

    def activate(model_id: str) -> links.Route:
        woken.wait(10)  # a wake slower than the caller's deadline
        return links.Route(f"{model_id}-0", "http://127.0.0.1:1")

    link = proxy.PoolLink(activate, released.append)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(link.activate("srv", "", 0), 0.05)
        assert released == []  # still waking
        woken.set()
        for _ in range(200):
            if released:
                break
            await asyncio.sleep(0.01)
        route = await link.activate("srv", "", 0)  # a caller that waits: its own release, once
        await link.release(route.instance)

    asyncio.run(main())
    assert released == ["srv-0", "srv-0"]


def test_a_release_the_pool_refuses_is_a_connection_error() -> None:
    def release(name: str) -> None:
        raise errors.UnknownModel(f"no instance {name!r}")

    link = proxy.PoolLink(lambda model_id: links.Route("srv-0", ""), release)
    with pytest.raises(ConnectionError, match="no instance 'srv-0'"):
        asyncio.run(link.release("srv-0"))


class _Shared:
    """A server instance whose one wake (FROZEN -> HOT) is made by the first activation; the others find it HOT."""

    def __init__(self) -> None:
        self.spec = api.ModelSpecSpec.model_validate({"modelId": "srv", "framework": "server", "source": "/srv",
                                                      "server": {"command": ["app", "{port}"]}})
        self.name = "srv-0"
        self.tier = api.Tier.FROZEN
        self.unix = False
        self.moves = [instance.Transition(api.Tier.FROZEN, api.Tier.HOT, 0.25, 0.0)]

    def acquire(self) -> instance.Transition | None:
        self.tier = api.Tier.HOT
        return self.moves.pop() if self.moves else None


def test_a_wake_shared_by_concurrent_activations_counts_once() -> None:
    agent_metrics = metrics.AgentMetrics()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        servers = serverpool.ServerPool("n", pathlib.Path("/nonexistent"), None, Settings(), agent_metrics, executor)
        shared = _Shared()
        servers.slots[shared.name] = serverpool.ServerSlot(shared, api.Tier.FROZEN)  # type: ignore[arg-type]
        first, second = servers.activate("srv"), servers.activate("srv")
    assert (first.woke_from, first.wake_ms) == (api.Tier.FROZEN, 250.0)
    assert (second.woke_from, second.wake_ms) == (api.Tier.HOT, 0.0)
    assert agent_metrics.activations.labels("FROZEN", "srv")._value.get() == 1
    assert len(servers.slots[shared.name].leases) == 2



def test_the_agent_api_releases_a_server_activation_its_caller_gave_up_on() -> None:
    import types

    from volga_agent.app import server

    fake = pools.Releases()
    service = server.AgentService(fake)  # type: ignore[arg-type]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for name in ("srv-0", "onnx-0"):  # a server's lease is given back; a model's activation holds nothing
            done = loop.create_future()
            done.set_result(types.SimpleNamespace(instance=types.SimpleNamespace(name=name)))
            service._given_up(done)
        failed = loop.create_future()
        failed.set_exception(errors.ActivationFailed("srv-1: no"))
        service._given_up(failed)

    asyncio.run(main())
    assert fake.released == ["srv-0"]
