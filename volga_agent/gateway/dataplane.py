"""The gateway's request path, once, for both protocols; `grpc_service.py` and `rest.py` only translate.

One inference request goes:

1. model: the `x-model-id` header, else the protocol's model name; unknown -> NOT_FOUND / 404;
2. `x-input-hash`, when sent, must equal the SHA-256 of the model's input schema -> else INVALID_ARGUMENT /
   400, before anything wakes;
3. tensors are decoded (by the adapter, with `oip`) and checked against the ModelSpec (names, dtypes, shapes,
   batch) -> INVALID_ARGUMENT;
4. `x-timeout-ms` (and the gRPC deadline) bound wake + inference -> DEADLINE_EXCEEDED / 504;
5. a model placed only on other nodes goes to one of their gateways (`links.Forwarder`), once;
6. the router gives a HOT instance (single-flight activation), the worker answers over AF_UNIX with the
   tensors in shared memory; a worker that went away is retried once through a fresh activation, then
   UNAVAILABLE / 503.

Failures are `oip.OipError`s (a gRPC status name and its HTTP status); `observe` maps the links' errors to
them and counts every request by model, protocol and outcome. The metadata answers (model state, platform,
tensor specs) are built here too, so both adapters give the same ones. See `docs/architecture.md`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from volga_agent import errors, metrics
from volga_agent.gateway import catalog, links, oip, router, workers
from volga_agent.worker import protocol
from volga_operator import api

T = TypeVar("T")

SERVER_NAME = "volga"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ("binary_tensor_data", "model_repository", "volga_wake_on_request")
UNKNOWN_MODEL_LABEL = "_unknown"
PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pytorch": "pytorch"}


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[oip.TensorSpec, ...]
    outputs: tuple[oip.TensorSpec, ...]


@dataclasses.dataclass(frozen=True)
class ModelState:
    """One entry of the repository index."""

    name: str
    version: str
    state: str  # READY or UNAVAILABLE


def headers(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Request headers (gRPC metadata or HTTP headers) with lower-case names; binary gRPC metadata is left out."""
    return {k.lower(): v for k, v in pairs if isinstance(v, str)}


def model_id(request_headers: Mapping[str, str], name: str) -> str:
    """The model a request is for: `x-model-id` when sent, else the name the protocol carries."""
    return request_headers.get("x-model-id") or name


def _tensor_specs(tensors: Iterable[api.TensorSpec]) -> tuple[oip.TensorSpec, ...]:
    return tuple((t.name, t.dtype.value, list(t.shape)) for t in tensors)


class Dataplane:
    def __init__(self, models: catalog.Catalog, link: links.AgentLink, node: str = "", cache_ttl_sec: float = 60.0,
                 max_request_bytes: int = 64 * 2**20, shm_bytes: int = 16 * 2**20,
                 gateway_metrics: metrics.GatewayMetrics | None = None) -> None:
        self.catalog = models
        self.node = node  # this gateway's node: instances elsewhere are not reachable through its agent
        self.max_request_bytes = max_request_bytes
        self.metrics = gateway_metrics or metrics.GatewayMetrics()
        self.router = router.Router(link, cache_ttl_sec, self.metrics)
        self.forwarder = links.Forwarder(max_request_bytes)
        self.workers = workers.WorkerClients(shm_bytes, on_zero_copy=self.metrics.zero_copy_latency.observe)

    # -- metadata ------------------------------------------------------------------------------------

    def model_ready(self, model: str) -> bool:
        return self.catalog.ready(model, self.node)

    def model_metadata(self, model: str) -> ModelMetadata:
        spec = self.catalog.get(model)
        return ModelMetadata(spec.model_id, (spec.version,), PLATFORMS[spec.framework.value],
                             _tensor_specs(spec.inputs), _tensor_specs(spec.outputs))

    def repository_index(self) -> list[ModelState]:
        return [ModelState(s.model_id, s.version, "READY" if self.model_ready(s.model_id) else "UNAVAILABLE")
                for s in self.catalog.all()]

    # -- inference -----------------------------------------------------------------------------------

    async def infer(self, model: str, request_headers: Mapping[str, str], inputs: dict[str, np.ndarray],
                    grpc_remaining: float | None = None) -> tuple[api.ModelSpecSpec, dict[str, np.ndarray]]:
        spec = self.catalog.get(model)
        claimed = request_headers.get("x-input-hash")
        if claimed and claimed.lower() != (schema := self.catalog.input_hash(model)):
            raise oip.error("INVALID_ARGUMENT", f"x-input-hash {claimed[:16]}... does not match model {model!r} "
                            f"(its input schema hash is {schema}); the client was built for "
                            "another version of the model")
        self.catalog.check_inputs(model, inputs)
        deadline = _deadline(request_headers.get("x-timeout-ms"), grpc_remaining)
        here = self.catalog.local(model, self.node)
        if here is not None and not here:
            return spec, await self._forward(model, request_headers, inputs, deadline)
        hint = request_headers.get("x-device-hint", "")
        for attempt in (1, 2):
            route = await _within(deadline, self.router.route(model, hint, _ms_left(deadline)), "waking an instance")
            try:
                return spec, await _within(deadline, self.workers.infer(route.socket, inputs), "inference")
            except (workers.WorkerGone, workers.WorkerDied) as exc:
                self.router.invalidate(model)
                self.workers.forget(route.socket)
                if isinstance(exc, workers.WorkerDied):
                    # It died while holding this request (which may be what killed it): fail this one only;
                    # the next request's activation finds the worker dead and restarts it.
                    raise oip.error("UNAVAILABLE", f"model {model!r}: {exc}; the instance is being "
                                    "restarted, retry") from None
                # Demoted or gone before it ran this request: wake again and resend, once.
                if attempt == 2:
                    raise oip.error("UNAVAILABLE", f"model {model!r}: {exc}; retry later") from None
            except protocol.WorkerError as exc:
                raise oip.error(exc.code, exc.message) from None
        raise AssertionError("unreachable")

    async def _forward(self, model: str, request_headers: Mapping[str, str], inputs: dict[str, np.ndarray],
                       deadline: float | None) -> dict[str, np.ndarray]:
        """The model lives on other nodes only: pass the request to one of their gateways (once)."""
        targets = self.catalog.remote_gateways(model, self.node)
        if request_headers.get(links.FORWARDED) or not targets:
            self.catalog.require_local(model, self.node)  # raises UNAVAILABLE naming the nodes
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        outputs = await _within(deadline, self.forwarder.infer(targets[0], model, inputs, request_headers,
                                                               self.node, timeout), "forwarding")
        self.metrics.forwards.labels(model).inc()
        return outputs

    async def observe(self, model: str, proto: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one request of an adapter: the links' errors become OipErrors, and the outcome is counted."""
        start = time.perf_counter()
        code = "OK"
        try:
            return await call()
        except oip.OipError as exc:
            code = exc.code
            raise
        except errors.UnknownModel as exc:
            code = "NOT_FOUND"
            raise oip.error(code, str(exc)) from None
        except errors.ActivationFailed as exc:
            code = "UNAVAILABLE"
            raise oip.error(code, f"could not wake model {model!r}: {exc}") from None
        finally:
            # Names clients make up must not become label values: one series per known model only.
            label = model if self.catalog.known(model) else UNKNOWN_MODEL_LABEL
            self.metrics.requests.labels(label, proto, code).inc()
            if code == "OK":
                self.metrics.latency.labels(label, proto).observe((time.perf_counter() - start) * 1e3)

    async def close(self) -> None:
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


async def _within(deadline: float | None, awaitable: Awaitable[T], what: str) -> T:
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise oip.error("DEADLINE_EXCEEDED", f"deadline (x-timeout-ms) expired while {what}") from None
