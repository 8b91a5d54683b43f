"""A model server's lease over the Agent API is a Hold call (`links.GrpcAgentLink.hold`): a real agent API server
(`app.server.AgentService`, its pool a stand-in that says which instance a request wakes and counts releases) and a
real gRPC client, in this process and in a process of its own that is killed mid-hold."""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time

import grpc
import pools
import pytest

from volga_agent import errors
from volga_agent.app import server
from volga_agent.gateway import links
from volga_agent.node import pool
from volga_agent.rpc.volga.v1 import agent_pb2_grpc
from volga_core import api


class _HeldPool(pools.Releases):
    """What the Agent API's Hold touches of the pool: an activation of srv (a server), any other model unknown."""

    def awaiting(self, model_id: str) -> None:
        return None

    def activate(self, model_id: str, name: str, device_hint: str) -> pool.Activation:
        if model_id != "srv":
            raise errors.UnknownModel(f"no instance of model {model_id!r}")
        info = pool.InstanceInfo("srv-0", "srv", "", api.Tier.HOT, "cpu", "http://127.0.0.1:1", "n", 0, 0.0, 0.0, "",
                                 "", api.Tier.FROZEN)
        return pool.Activation(info, api.Tier.FROZEN, 12.0, False)


_HOLDER = """
import asyncio, sys
from volga_agent.gateway import links

async def main():
    async with links.GrpcAgentLink(sys.argv[1]).hold("srv", 5000) as route:
        print("held", route.instance, flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_hold_is_released_when_its_caller_leaves_the_block_or_dies(tmp_path: pathlib.Path) -> None:
    """The gateway's lease of a server over the Agent API is a Hold call: the agent releases the server when the
    gateway ends the call, and when the gateway's process is killed mid-request (its connection gone), not an hour
    later (`serverpool.LEASE_MAX_SEC`)."""
    fake = _HeldPool()
    address = f"unix:{tmp_path / 'agent.sock'}"

    async def released(count: int) -> None:
        for _ in range(500):
            if len(fake.released) >= count:
                return
            await asyncio.sleep(0.01)

    async def main() -> None:
        grpc_server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(server.AgentService(fake), grpc_server)  # type: ignore[arg-type]
        grpc_server.add_insecure_port(address)
        await grpc_server.start()
        link = links.GrpcAgentLink(address)
        try:
            async with link.hold("srv", 5000) as route:
                assert route.instance == "srv-0"
                await asyncio.sleep(0.2)
                assert fake.released == []  # held while the block runs
            await released(1)
            assert fake.released == ["srv-0"]
            with pytest.raises(errors.UnknownModel, match="no instance of model 'other'"):
                async with link.hold("other", 5000):
                    pass
            holder = subprocess.Popen([sys.executable, "-c", _HOLDER, address], stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None
            line = await asyncio.to_thread(holder.stdout.readline)
            assert line.split() == ["held", "srv-0"], line
            await asyncio.sleep(0.2)
            assert fake.released == ["srv-0"]
            killed = time.monotonic()
            holder.kill()
            holder.wait()
            await released(2)
            assert fake.released == ["srv-0", "srv-0"], "the dead caller's hold was not released"
            assert time.monotonic() - killed < 5
        finally:
            await link.close()
            await grpc_server.stop(None)

    asyncio.run(main())
