"""Forwarding to another node's gateway, for models this node holds no instance of.

Behind a Service, any gateway pod may receive a request; the model may be placed on other nodes only. The
EMI watch tells where (each agent reports its gateway's address in EMI status), and this gateway sends the
request on over gRPC, once: forwarded requests carry `x-volga-forwarded` and are never forwarded again.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import numpy as np

from volga_agent.gateway import oip
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc

FORWARDED = "x-volga-forwarded"
PASSED_ON = ("x-input-hash", "x-device-hint")


class Forwarder:
    def __init__(self, max_message_bytes: int = 64 * 2**20) -> None:
        self.max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.GRPCInferenceServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            options = [("grpc.max_receive_message_length", self.max_message_bytes),
                       ("grpc.max_send_message_length", self.max_message_bytes)]
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=options)
        return pb_grpc.GRPCInferenceServiceStub(channel)

    async def infer(self, address: str, model_id: str, inputs: Mapping[str, np.ndarray], headers: Mapping[str, str],
                    origin: str, timeout: float | None) -> dict[str, np.ndarray]:
        metadata = [("x-model-id", model_id), (FORWARDED, origin or "unknown")]
        metadata += [(k, headers[k]) for k in PASSED_ON if headers.get(k)]
        try:
            response = await self._stub(address).ModelInfer(oip.encode_grpc_request(model_id, inputs),
                                                            metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise oip.error(exc.code().name, f"forwarded to the gateway at {address}: {exc.details()}") from None
        return oip.decode_grpc_response(response)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
