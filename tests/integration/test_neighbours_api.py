"""Neighbours over a real Agent API (a gRPC server in this process): levels traded, refused with the reason or
naming the field, handed to the gateway's ExchangeLoad; a neighbour that starts late is heard within a second."""

from __future__ import annotations

import asyncio
import pathlib
import time

import grpc
import pytest
from neighbour_levels import Fixed, level, run

from volga_agent import neighbours
from volga_agent.app import server
from volga_agent.autonomy import exchange
from volga_agent.node import pool
from volga_agent.rpc.volga.v1 import agent_pb2 as pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as agent_grpc


def test_the_agent_api_trades_levels_and_hands_them_to_its_gateway(tmp_path: pathlib.Path) -> None:
    """ExchangeLevel over a real Agent API: refused with the reason while this node takes no part, INVALID_ARGUMENT
    naming the field for a bad level, else the caller's level is kept and this node's comes back; the gateway's
    ExchangeLoad then carries the node's state and the caller's level with its age."""
    node_pool = pool.Pool("a", tmp_path / "w", None)
    steering = exchange.Exchange()
    steering.shed("m", 300)
    source = Fixed(level("a", state="EMERGENCY", m="hot"))

    async def scenario() -> None:
        off, _ = await server.serve(node_pool, "127.0.0.1", 0, str(tmp_path / "off.sock"), exchange=steering,
                                    levels_off="neighboursEnabled is false")
        levels = neighbours.LevelExchange("a", source)
        on, _ = await server.serve(node_pool, "127.0.0.1", 0, str(tmp_path / "on.sock"), exchange=steering,
                                   levels=levels)
        try:
            async with grpc.aio.insecure_channel(f"unix:{tmp_path / 'off.sock'}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent_grpc.AgentStub(channel).ExchangeLevel(neighbours.to_pb(level("b")))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "node a takes no part in the neighbour exchange: neighboursEnabled is false" in str(
                    err.value.details())
            async with grpc.aio.insecure_channel(f"unix:{tmp_path / 'on.sock'}") as channel:
                stub = agent_grpc.AgentStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ExchangeLevel(pb.NodeLevel(state="ACCEPT"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "level.node is required"
                reply = await stub.ExchangeLevel(neighbours.to_pb(level("b", load=3, m="hot"), age_ms=20))
                ours, _ = neighbours.from_pb(reply)
                assert (ours.node, ours.state, ours.sequence > 0) == ("a", "EMERGENCY", True)
                load = await stub.ExchangeLoad(pb.ExchangeLoadRequest())
                assert load.state == "EMERGENCY" and dict(load.shed_retry_after_ms) == {"m": 300}
                [theirs] = load.neighbours
                assert (theirs.node, theirs.load, theirs.age_ms >= 20) == ("b", 3.0, True)
        finally:
            await off.stop(0)
            await on.stop(0)

    try:
        run(scenario())
    finally:
        node_pool.close()


def test_a_neighbour_that_starts_late_is_heard_within_a_second_of_listening(tmp_path: pathlib.Path) -> None:
    """Node b trades with node a while nothing listens on a's address; gRPC's channel backs off further after each
    failed attempt (1 s, 1.6 s, 2.6 s, ... by default), so a's level used to go unheard for seconds, up to two
    minutes, after a started. Now b hears it within about a second."""
    from volga_bench import controlplane

    [port] = controlplane.free_ports(1)
    node_pool = pool.Pool("a", tmp_path / "w", None)

    async def scenario() -> None:
        b = neighbours.LevelExchange("b", Fixed(level("b")))
        b.set_directory({"a": f"127.0.0.1:{port}", "b": "127.0.0.1:1"})
        assert b.neighbours() == ("a",)
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:  # five or six failed attempts: the next is seconds away by default
            await b.exchange_once()
            await asyncio.sleep(0.05)
        assert not b.fresh()
        a, bound = await server.serve(node_pool, "127.0.0.1", port, levels=neighbours.LevelExchange(
            "a", Fixed(level("a", state="OPTIMIZE"))))
        assert bound == port
        try:
            heard = time.monotonic() + 1.5
            while not b.fresh() and time.monotonic() < heard:
                await b.exchange_once()
                await asyncio.sleep(0.05)
            assert [h.level.node for h in b.fresh()] == ["a"], "a's level was not heard within 1.5 s"
        finally:
            await a.stop(0)
            await b.stop()

    try:
        run(scenario())
    finally:
        node_pool.close()
