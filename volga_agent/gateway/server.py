"""The gateway: Open Inference Protocol v2 over gRPC and REST, routing by `x-model-id`.

Wire-compatible with an unmodified `tritonclient` (defaults: HTTP 8000, gRPC 8001, metrics 8002). One
request goes:

1. model: the `x-model-id` header, else the protocol's model name; unknown -> NOT_FOUND / 404;
2. `x-input-hash`, when sent, must equal the SHA-256 of the model's input schema -> else INVALID_ARGUMENT /
   400, before anything wakes;
3. tensors are decoded and checked against the ModelSpec (names, dtypes, shapes, batch) -> INVALID_ARGUMENT;
4. `x-timeout-ms` (and the gRPC deadline) bound wake + inference -> DEADLINE_EXCEEDED / 504;
5. the router gives a HOT instance (single-flight activation), the worker answers over AF_UNIX with the
   tensors in shared memory; a worker that went away is retried once through a fresh activation, then
   UNAVAILABLE / 503.

Everything runs on one asyncio loop: grpc.aio for gRPC, aiohttp for REST and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import prometheus_client as prom
from aiohttp import web

from volga_agent import instance, metrics
from volga_agent.gateway import oip, remote, router, workers
from volga_agent.rpc.inference import grpc_service_pb2 as pb
from volga_agent.rpc.inference import grpc_service_pb2_grpc as pb_grpc
from volga_agent.worker import contract, protocol
from volga_operator import api

log = logging.getLogger(__name__)

SERVER_NAME = "volga"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ("binary_tensor_data", "model_repository", "volga_wake_on_request")
UNKNOWN_MODEL_LABEL = "_unknown"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an instance of a model is, as the cluster's EMIs say (cluster mode only)."""

    instance: str
    node: str
    tier: str
    ready: bool
    gateway: str = ""  # the gRPC address of that node's gateway, as its agent reports it


@dataclasses.dataclass(frozen=True)
class Settings:
    node: str = ""  # this gateway's node: instances elsewhere are not reachable through its agent
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    cache_ttl_sec: float = 60.0
    max_request_bytes: int = 64 * 2**20
    shm_bytes: int = 16 * 2**20


class Catalog:
    """The models this gateway can route to (from the local store, or a ModelSpec watch in a cluster)."""

    def __init__(self, specs: Mapping[str, api.ModelSpecSpec] | None = None) -> None:
        self._models: dict[str, api.ModelSpecSpec] = {}
        self._decls: dict[str, tuple[contract.TensorDecl, ...]] = {}
        # model id -> its instances in the cluster (an EMI watch fills it); None: not known (no cluster).
        self._placements: dict[str, tuple[Placement, ...]] | None = None
        self.replace(list((specs or {}).values()))

    def set_placements(self, placements: Mapping[str, Sequence[Placement]]) -> None:
        self._placements = {model: tuple(p) for model, p in placements.items()}

    def local(self, model_id: str, node: str) -> tuple[Placement, ...] | None:
        """This node's instances of the model; None when placements are not known (embedded mode)."""
        if self._placements is None or not node:
            return None
        return tuple(p for p in self._placements.get(model_id, ()) if p.node == node)

    def require_local(self, model_id: str, node: str) -> None:
        """Fail fast, before any wake, when the cluster placed the model only on other nodes."""
        here = self.local(model_id, node)
        if here is None or here:
            return
        assert self._placements is not None
        elsewhere = sorted({p.node for p in self._placements.get(model_id, ())})
        where = f"its instances are on {', '.join(elsewhere)}" if elsewhere else "it has no instance yet"
        raise oip.error("UNAVAILABLE", f"model {model_id!r} has no instance on node {node}: {where}; "
                        "send the request to a gateway on one of those nodes")

    def remote_gateways(self, model_id: str, node: str) -> list[str]:
        """Gateways of other nodes holding the model: ready HOT instances first, then ready, then any."""
        if self._placements is None:
            return []
        others = [p for p in self._placements.get(model_id, ()) if p.node != node and p.gateway]
        others.sort(key=lambda p: (not p.ready, p.tier != "HOT", p.node))
        return list(dict.fromkeys(p.gateway for p in others))

    def ready(self, model_id: str, node: str) -> bool:
        if model_id not in self._models:
            return False
        here = self.local(model_id, node)
        return here is None or any(p.ready for p in here)

    def replace(self, specs: list[api.ModelSpecSpec]) -> None:
        self._models = {s.model_id: s for s in specs}
        self._decls = {s.model_id: instance.decls(s.inputs) for s in specs}
        self._hashes = {s.model_id: s.input_hash() for s in specs}

    def known(self, model_id: str) -> bool:
        return model_id in self._models

    def get(self, model_id: str) -> api.ModelSpecSpec:
        spec = self._models.get(model_id)
        if spec is None:
            raise oip.error("NOT_FOUND", f"unknown model {model_id!r}: no ModelSpec has this modelId")
        return spec

    def decls(self, model_id: str) -> tuple[contract.TensorDecl, ...]:
        return self._decls[model_id]

    def input_hash(self, model_id: str) -> str:
        return self._hashes[model_id]

    def all(self) -> list[api.ModelSpecSpec]:
        return sorted(self._models.values(), key=lambda s: s.model_id)


class Gateway:
    def __init__(self, catalog: Catalog, link: router.AgentLink, settings: Settings | None = None,
                 gateway_metrics: metrics.GatewayMetrics | None = None,
                 extra_metrics: list[prom.CollectorRegistry] | None = None) -> None:
        self.catalog = catalog
        self.settings = settings or Settings()
        self.metrics = gateway_metrics or metrics.GatewayMetrics()
        self.router = router.Router(link, self.settings.cache_ttl_sec, self.metrics)
        self.forwarder = remote.Forwarder(self.settings.max_request_bytes)
        self.workers = workers.WorkerClients(self.settings.shm_bytes,
                                             on_zero_copy=self.metrics.zero_copy_latency.observe)
        self.extra_metrics = extra_metrics or []
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self.ports: dict[str, int] = {}

    # -- the request path shared by both protocols ---------------------------------------------------

    async def infer(self, model_id: str, headers: Mapping[str, str], inputs: dict[str, np.ndarray],
                    grpc_remaining: float | None = None) -> tuple[api.ModelSpecSpec, dict[str, np.ndarray]]:
        spec = self.catalog.get(model_id)
        claimed = headers.get("x-input-hash")
        if claimed and claimed.lower() != (schema := self.catalog.input_hash(model_id)):
            raise oip.error("INVALID_ARGUMENT", f"x-input-hash {claimed[:16]}... does not match model {model_id!r} "
                            f"(its input schema hash is {schema}); the client was built for "
                            "another version of the model")
        try:
            contract.check_inputs(self.catalog.decls(model_id), inputs, spec.runtime.max_batch_size)
        except protocol.WorkerError as exc:
            raise oip.error(exc.code, exc.message) from None
        deadline = _deadline(headers.get("x-timeout-ms"), grpc_remaining)
        here = self.catalog.local(model_id, self.settings.node)
        if here is not None and not here:
            return spec, await self._forward(model_id, headers, inputs, deadline)
        hint = headers.get("x-device-hint", "")
        for attempt in (1, 2):
            route = await _within(deadline, self.router.route(model_id, hint, _ms_left(deadline)),
                                  "waking an instance")
            try:
                outputs = await _within(deadline, self.workers.infer(route.socket, inputs), "inference")
                return spec, outputs
            except (workers.WorkerGone, workers.WorkerDied) as exc:
                self.router.invalidate(model_id)
                self.workers.forget(route.socket)
                if isinstance(exc, workers.WorkerDied):
                    # It died while holding this request (which may be what killed it): fail this one only;
                    # the next request's activation finds the worker dead and restarts it.
                    raise oip.error("UNAVAILABLE", f"model {model_id!r}: {exc}; the instance is being "
                                    "restarted, retry") from None
                # Demoted or gone before it ran this request: wake again and resend, once.
                if attempt == 2:
                    raise oip.error("UNAVAILABLE", f"model {model_id!r}: {exc}; retry later") from None
            except protocol.WorkerError as exc:
                raise oip.error(exc.code, exc.message) from None
        raise AssertionError("unreachable")

    async def _forward(self, model_id: str, headers: Mapping[str, str], inputs: dict[str, np.ndarray],
                       deadline: float | None) -> dict[str, np.ndarray]:
        """The model lives on other nodes only: pass the request to one of their gateways (once)."""
        targets = self.catalog.remote_gateways(model_id, self.settings.node)
        if headers.get(remote.FORWARDED) or not targets:
            self.catalog.require_local(model_id, self.settings.node)  # raises UNAVAILABLE naming the nodes
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        outputs = await _within(deadline, self.forwarder.infer(targets[0], model_id, inputs, headers,
                                                               self.settings.node, timeout), "forwarding")
        self.metrics.forwards.labels(model_id).inc()
        return outputs  # type: ignore[no-any-return]

    async def _observed(self, model_id: str, proto: str, call: Callable[[], Awaitable[Any]]) -> Any:
        start = time.perf_counter()
        code = "OK"
        try:
            return await call()
        except oip.OipError as exc:
            code = exc.code
            raise
        except router.UnknownModel as exc:
            code = "NOT_FOUND"
            raise oip.error(code, str(exc)) from None
        except router.ActivationFailed as exc:
            code = "UNAVAILABLE"
            raise oip.error(code, f"could not wake model {model_id!r}: {exc}") from None
        finally:
            # Names clients make up must not become label values: one series per known model only.
            label = model_id if self.catalog.known(model_id) else UNKNOWN_MODEL_LABEL
            self.metrics.requests.labels(label, proto, code).inc()
            if code == "OK":
                self.metrics.latency.labels(label, proto).observe((time.perf_counter() - start) * 1e3)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        options = [("grpc.max_receive_message_length", s.max_request_bytes),
                   ("grpc.max_send_message_length", s.max_request_bytes), ("grpc.so_reuseport", 0)]
        self._grpc = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_GrpcService(self), self._grpc)
        self.ports["grpc"] = self._grpc.add_insecure_port(f"{s.host}:{s.grpc_port}")
        if self.ports["grpc"] == 0:
            raise OSError(f"cannot listen on {s.host}:{s.grpc_port} (gRPC)")
        await self._grpc.start()
        self.ports["http"] = await self._serve(_rest_app(self), s.http_port)
        self.ports["metrics"] = await self._serve(self._metrics_app(), s.metrics_port)

    async def _serve(self, app: web.Application, port: int) -> int:
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self.settings.host, port, reuse_address=True)
        await site.start()
        self._runners.append(runner)
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    def _metrics_app(self) -> web.Application:
        async def handle(_: web.Request) -> web.Response:
            body = b"".join(prom.generate_latest(r) for r in [self.metrics.registry, *self.extra_metrics])
            return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", handle)
        return app

    async def stop(self, grace: float = 2.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace)
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        self.workers.close()
        await self.forwarder.close()
        await self.router.link.close()


def _deadline(timeout_ms: str | None, grpc_remaining: float | None) -> float | None:
    budget = grpc_remaining
    if timeout_ms:
        try:
            value = float(timeout_ms)
        except ValueError:
            raise oip.error("INVALID_ARGUMENT", f"x-timeout-ms {timeout_ms!r} is not a number") from None
        if value <= 0:
            raise oip.error("INVALID_ARGUMENT", f"x-timeout-ms must be positive, got {timeout_ms}")
        budget = value / 1e3 if budget is None else min(budget, value / 1e3)
    return None if budget is None else time.monotonic() + budget


def _ms_left(deadline: float | None) -> int:
    return 0 if deadline is None else max(1, int((deadline - time.monotonic()) * 1e3))


async def _within(deadline: float | None, awaitable: Awaitable[Any], what: str) -> Any:
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise oip.error("DEADLINE_EXCEEDED", f"deadline (x-timeout-ms) expired while {what}") from None


# -- gRPC ----------------------------------------------------------------------------------------------


class _GrpcService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=list(EXTENSIONS))

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model_id = _metadata(context).get("x-model-id") or request.name
        return pb.ModelReadyResponse(ready=self.gw.catalog.ready(model_id, self.gw.settings.node))

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model_id = _metadata(context).get("x-model-id") or request.name
        try:
            spec = self.gw.catalog.get(model_id)
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        return oip.model_metadata_grpc(spec.model_id, [spec.version], _platform(spec), *_tensor_specs(spec))

    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        response = pb.RepositoryIndexResponse()
        for spec in self.gw.catalog.all():
            response.models.add(name=spec.model_id, version=spec.version, state=_state(self.gw, spec))
        return response

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        headers = _metadata(context)
        model_id = headers.get("x-model-id") or request.model_name

        async def call() -> Any:
            inputs, requested = oip.decode_grpc_request(request)
            spec, outputs = await self.gw.infer(model_id, headers, inputs, context.time_remaining())
            return oip.encode_grpc_response(spec.model_id, spec.version, request.id,
                                            oip.select_outputs(outputs, requested))

        try:
            return await self.gw._observed(model_id, "grpc", call)
        except oip.OipError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)


def _state(gw: Gateway, spec: api.ModelSpecSpec) -> str:
    return "READY" if gw.catalog.ready(spec.model_id, gw.settings.node) else "UNAVAILABLE"


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _platform(spec: api.ModelSpecSpec) -> str:
    return {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pytorch": "pytorch"}[spec.framework.value]


def _tensor_specs(spec: api.ModelSpecSpec) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]:
    return ([(t.name, t.dtype.value, list(t.shape)) for t in spec.inputs],
            [(t.name, t.dtype.value, list(t.shape)) for t in spec.outputs])


# -- REST ----------------------------------------------------------------------------------------------


def _rest_app(gw: Gateway) -> web.Application:
    def error(exc: oip.OipError) -> web.Response:
        return web.Response(status=exc.http_status, body=oip.rest_error_body(exc), content_type="application/json")

    def model_of(request: web.Request) -> api.ModelSpecSpec:
        return gw.catalog.get(request.headers.get("x-model-id") or request.match_info["model"])

    async def live(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_metadata(_: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)})

    async def model_ready(request: web.Request) -> web.Response:
        model_id = request.headers.get("x-model-id") or request.match_info["model"]
        return web.Response(status=200 if gw.catalog.ready(model_id, gw.settings.node) else 400)

    async def model_metadata(request: web.Request) -> web.Response:
        try:
            spec = model_of(request)
        except oip.OipError as exc:
            return error(exc)
        return web.json_response(oip.model_metadata_rest(spec.model_id, [spec.version], _platform(spec),
                                                         *_tensor_specs(spec)))

    async def repository_index(_: web.Request) -> web.Response:
        return web.json_response([{"name": s.model_id, "version": s.version, "state": _state(gw, s)}
                                  for s in gw.catalog.all()])

    async def infer(request: web.Request) -> web.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        model_id = headers.get("x-model-id") or request.match_info["model"]

        async def call() -> web.Response:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                limit = gw.settings.max_request_bytes
                raise oip.error("RESOURCE_EXHAUSTED", f"request body over {limit} bytes") from None
            length = headers.get("inference-header-content-length")
            try:
                header_length = int(length) if length is not None else None
            except ValueError:
                raise oip.error("INVALID_ARGUMENT",
                                f"Inference-Header-Content-Length {length!r} is not a number") from None
            decoded = oip.decode_rest_request(body, header_length)
            spec, outputs = await gw.infer(model_id, headers, decoded.inputs)
            payload, json_length = oip.encode_rest_response(spec.model_id, spec.version, decoded.request_id, outputs,
                                                            decoded.outputs, decoded.binary_default)
            response_headers = {"Content-Type": "application/json" if json_length is None else
                                "application/octet-stream"}
            if json_length is not None:
                response_headers["Inference-Header-Content-Length"] = str(json_length)
            return web.Response(body=payload, headers=response_headers)

        try:
            return await gw._observed(model_id, "http", call)  # type: ignore[no-any-return]
        except oip.OipError as exc:
            return error(exc)

    app = web.Application(client_max_size=gw.settings.max_request_bytes)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", live)
    app.router.add_get("/v2", server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_get(prefix, model_metadata)
        app.router.add_get(f"{prefix}/ready", model_ready)
        app.router.add_post(f"{prefix}/infer", infer)
    app.router.add_post("/v2/repository/index", repository_index)
    return app

