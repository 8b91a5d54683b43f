"""How a gateway reaches an agent over gRPC (the sidecar case); `local.py` has the in-process link."""

from __future__ import annotations

import grpc

from volga_agent.gateway import router
from volga_agent.rpc.volga.v1 import agent_pb2 as pb
from volga_agent.rpc.volga.v1 import agent_pb2_grpc as pb_grpc


class GrpcAgentLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.AgentStub(self.channel)

    async def activate(self, model_id: str, device_hint: str, timeout_ms: int) -> router.Route:
        request = pb.ActivateRequest(model_id=model_id, device_hint=device_hint, timeout_ms=timeout_ms)
        try:
            reply = await self.stub.Activate(request, timeout=timeout_ms / 1e3 if timeout_ms else None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise router.UnknownModel(exc.details()) from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(exc.details()) from None
            raise router.ActivationFailed(f"agent {self.address}: {exc.code().name}: {exc.details()}") from None
        return router.Route(reply.instance.name, reply.instance.socket)

    async def close(self) -> None:
        await self.channel.close()
