"""The gateway's gRPC adapter: `inference.GRPCInferenceService` (what tritonclient.grpc calls) over the dataplane.

Each method decodes its request with `oip`, asks the dataplane and encodes the answer; an `oip.OipError`
aborts the call with its status. Nothing here decides anything (`docs/architecture.md`).
"""

from __future__ import annotations

from typing import Any

import grpc

from volga_agent.gateway import dataplane, oip
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return dataplane.headers(context.invocation_metadata() or ())


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: dataplane.Dataplane) -> None:
        self.plane = plane

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(name=dataplane.SERVER_NAME, version=dataplane.SERVER_VERSION,
                                         extensions=list(dataplane.EXTENSIONS))

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ModelReadyResponse(ready=self.plane.model_ready(dataplane.model_id(_headers(context), request.name)))

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            m = self.plane.model_metadata(dataplane.model_id(_headers(context), request.name))
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        return oip.model_metadata_grpc(m.name, m.versions, m.platform, m.inputs, m.outputs)

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = pb.RepositoryIndexResponse()
        for m in self.plane.repository_index():
            response.models.add(name=m.name, version=m.version, state=m.state)
        return response

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        headers = _headers(context)
        model = dataplane.model_id(headers, request.model_name)

        async def call() -> Any:
            inputs, requested = oip.decode_grpc_request(request)
            spec, outputs = await self.plane.infer(model, headers, inputs, context.time_remaining())
            return oip.encode_grpc_response(spec.model_id, spec.version, request.id,
                                            oip.select_outputs(outputs, requested))

        try:
            return await self.plane.observe(model, "grpc", call)
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
