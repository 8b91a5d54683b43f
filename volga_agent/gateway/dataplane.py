"""The gateway's request path, once, for both protocols; `grpc_service.py` and `rest.py` only translate.

One inference request goes:

1. model: the `x-model-id` header, else the protocol's model name; unknown -> NOT_FOUND / 404; one the catalog
   refuses (a ModelSpec `volga up` could not load) -> UNAVAILABLE / 503 with the reason, before the body is decoded;
2. `x-input-hash`, when sent, must equal the SHA-256 of the model's input schema -> else INVALID_ARGUMENT /
   400, before anything wakes;
3. tensors are decoded (by the adapter, with `oip`) and checked against the ModelSpec (names, dtypes, shapes,
   batch) -> INVALID_ARGUMENT;
4. `x-timeout-ms` (and the gRPC deadline) bound wake + inference -> DEADLINE_EXCEEDED / 504;
5. a model placed only on other nodes goes to one of their gateways (`links.Forwarder`), once; so does a request
   of an overloaded node (its model shed, or the node in EMERGENCY): to the least-loaded neighbour that can take
   it (`neighbours.choose`), once, instead of a refusal (RESOURCE_EXHAUSTED only when no neighbour takes it);
   a model with `runtime.dynamicBatching` waits in its batcher's queue (`batcher.py`) and runs with others;
6. the router gives a HOT instance (single-flight activation), the worker answers over AF_UNIX with the
   tensors in shared memory; a request a worker handed back unrun (it paused for a checkpoint, or sleeps) is
   resent after a fresh activation, up to `UNRUN_ATTEMPTS` sends; a worker that died holding the request, or
   a request handed back that often, is UNAVAILABLE / 503.

Failures are `oip.OipError`s (a gRPC status name and its HTTP status); `observe` maps the links' errors to
them, anything unexpected to INTERNAL and a client that went away to CANCELLED, and counts every request by
model, protocol and outcome. Decoding a large body runs in a thread (`off_loop`) so that it does not hold up
the other requests on the event loop.

A node's autonomy loop steers the gateway through four calls, safe from any thread: `set_batch_cap` (the most
rows a batch of a model takes), `shed` / `unshed` (refuse a model's requests at once, RESOURCE_EXHAUSTED / 429
with a retry hint) and `drain_load` (each model's arrivals, completions, latencies and queue since the last
call, as `ModelLoad`s); `set_neighbours` gives it the node's state and its neighbours' levels. An ensemble's
request counts under its own id, and each of its steps as a request of that step's model; an ensemble that needs
a shed model is refused as a whole, before its first step. A model server's requests, which the proxies pass
through past `observe`, count in its load all the same (`served`), and a shed server's are refused there, before
any wake, as a shed model's are in `observe` (a server batches itself: the loop's caps do not reach it), unless
a neighbour takes them (`neighbour_for`, `passed_on`), as it takes a shed model's.

The metadata answers (model state from what the agent reports, platform, tensor specs, a Triton-style model
configuration) are built here too, so both adapters give the same ones; an output whose answers contradict its
declared shape (a worker's warm-up saw them) is given with the shape it answers with (`answered_outputs`). An
ensemble (a chain served as one model, `ensemble.py`) is answered here as well: its steps go through steps 5-6 one
model after the other, and its metadata and configuration are Triton's for an ensemble. See `docs/architecture.md`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, Protocol, TypeVar

import numpy as np

from volga_agent import errors, load, metrics, neighbours
from volga_agent.gateway import batcher, catalog, ensemble, links, oip, router, workers
from volga_agent.worker import protocol
from volga_core import api

T = TypeVar("T")
P = ParamSpec("P")
# Sends of one request that workers may hand back unrun (paused for a checkpoint, asleep) before it fails. Each
# hand-back is a distinct demotion of the model, so this bounds how many demotions in a row (snapshots, idle
# moves, the autonomy loop) a request rides out; the request's deadline bounds the time.
UNRUN_ATTEMPTS = 8
log = logging.getLogger(__name__)

SERVER_NAME = "volga"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ("binary_tensor_data", "model_repository", "model_configuration", "volga_wake_on_request")
UNKNOWN_MODEL_LABEL = "_unknown"
PLATFORMS = {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "pytorch": "pytorch"}
BACKENDS = {"onnx": "onnxruntime", "torchscript": "pytorch", "pytorch": "pytorch"}
# Bodies at least this large are decoded in a thread; smaller ones cost less to decode than the hand-off.
OFF_LOOP_BYTES = 1 << 20
# Latencies a model keeps for `drain_load` between two calls (the latest ones), so an undrained gateway stays small.
MAX_LOAD_LATENCIES = 65_536


@dataclasses.dataclass(frozen=True)
class _Diverted:
    """A request `observe` let through although its node is overloaded, for `_dispatch` to pass to a neighbour."""

    model: str
    retry_after_ms: int | None  # the shed model's retry hint; None: not shed (the node is in EMERGENCY)


_diverted: contextvars.ContextVar[_Diverted | None] = contextvars.ContextVar("diverted", default=None)


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[oip.TensorSpec, ...]
    outputs: tuple[oip.TensorSpec, ...]


@dataclasses.dataclass(frozen=True)
class DynamicBatchingConfig:
    """Triton's ModelDynamicBatching, as far as a ModelSpec's runtime.dynamicBatching fills it."""

    preferred_batch_size: tuple[int, ...]
    max_queue_delay_microseconds: int
    max_queue_size: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A model's configuration as Triton describes one (model_config.proto), derived from its ModelSpec."""

    name: str
    platform: str
    backend: str
    max_batch_size: int  # > 0: every tensor's first dimension is the batch, and is left out of dims
    inputs: tuple[oip.TensorSpec, ...]
    outputs: tuple[oip.TensorSpec, ...]
    dynamic_batching: DynamicBatchingConfig | None = None  # set when the gateway batches the model's requests
    ensemble_steps: tuple[ensemble.Step, ...] = ()  # set for an ensemble: its models, in order


ModelLoad = load.ModelLoad


@dataclasses.dataclass
class _Load:
    arrivals: int = 0
    completed: int = 0
    shed: int = 0
    latencies_ms: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_LOAD_LATENCIES))


@dataclasses.dataclass(frozen=True)
class ModelState:
    """One entry of the repository index."""

    name: str
    version: str
    state: str  # READY or UNAVAILABLE
    reason: str = ""  # the tiers of its instances, and why it is UNAVAILABLE

    @property
    def ready(self) -> bool:
        return self.state == "READY"


def headers(pairs: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Request headers (gRPC metadata or HTTP headers) with lower-case names; binary gRPC metadata is left out."""
    return {k.lower(): v for k, v in pairs if isinstance(v, str)}


def model_id(request_headers: Mapping[str, str], name: str) -> str:
    """The model a request is for: `x-model-id` when sent, else the name the protocol carries. A request that names
    two different models (the header and the URL or message) is the client's error, never a silent choice."""
    header = request_headers.get("x-model-id")
    if header and name and header != name:
        raise oip.error("INVALID_ARGUMENT", f"x-model-id {header!r} and the request's model name {name!r} name "
                        "different models: send the same model in both, or only one of them")
    return header or name


def _tensor_specs(tensors: Iterable[api.TensorSpec], skip: int = 0) -> tuple[oip.TensorSpec, ...]:
    """(name, dtype, dims) of each tensor, without its first `skip` dimensions."""
    return tuple((t.name, t.dtype.value, list(t.shape[skip:])) for t in tensors)


class Guard(Protocol):
    """A guarded throttle of the node's autonomy loop (`volga_agent.host.throttle.DutyCycle`, guarded), in this process:
    while co-runners give way, each worker call of a model they give way to is marked in flight."""

    def protects(self, model: str) -> bool: ...

    def enter(self) -> None: ...

    def leave(self) -> None: ...


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
        self.batchers: dict[str, batcher.Batcher] = {}
        # What the autonomy calls set, from any thread: guarded by one lock, held only for a few dict operations.
        self._lock = threading.Lock()
        self._caps: dict[str, int] = {}
        self._shed: dict[str, int] = {}  # model -> retry hint, in milliseconds
        self._loads: dict[str, _Load] = {}
        self._outstanding: dict[str, int] = {}
        self._state = ""  # the node's autonomy state
        self._neighbours: tuple[neighbours.Heard, ...] = ()
        # The labelled children of the request counters, looked up once each: labels() locks and hashes every time.
        self._counted: dict[tuple[str, str, str], Any] = {}
        self._timed: dict[tuple[str, str], Any] = {}
        self.guard: Guard | None = None  # `set_guard`

    def set_guard(self, guard: Guard | None) -> None:
        """The autonomy loop's guarded throttle, when it runs in this process (`volga up --autonomy`): the worker
        calls of the models it protects tell it when their work is in flight; None: no more."""
        self.guard = guard

    # -- control (a node's autonomy loop; any thread) ------------------------------------------------

    def set_batch_cap(self, model: str, cap: int | None) -> None:
        """The most rows a batch of the model takes from now on (at most runtime.maxBatchSize; preferred sizes
        above it are skipped); None: back to the spec's. No effect on a model without dynamic batching."""
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"batch cap of model {model!r} must be a positive number of rows or None, got {cap!r}")
        self._require(model)
        with self._lock:
            if cap is None:
                self._caps.pop(model, None)
            else:
                self._caps[model] = cap
            found = self.batchers.get(model)
        if found is not None:
            found.set_cap(cap)

    def shed(self, model: str, retry_after_ms: int) -> None:
        """Refuse the model's requests at once (RESOURCE_EXHAUSTED / 429) until `unshed`, with a hint to retry
        after `retry_after_ms` (REST Retry-After in whole seconds, rounded up; gRPC trailer retry-after-ms)."""
        if isinstance(retry_after_ms, bool) or not isinstance(retry_after_ms, int) or retry_after_ms < 0:
            raise ValueError(f"retry_after_ms of model {model!r} must be a number of milliseconds >= 0, "
                             f"got {retry_after_ms!r}")
        self._require(model)
        with self._lock:
            self._shed[model] = retry_after_ms

    def unshed(self, model: str) -> None:
        with self._lock:
            self._shed.pop(model, None)

    def sheds(self, model: str) -> bool:
        """Whether the model's requests are refused now (`shed`). Safe from any thread."""
        with self._lock:
            return model in self._shed

    def set_neighbours(self, state: str, heard: tuple[neighbours.Heard, ...]) -> None:
        """The node's autonomy state and its neighbours' levels (the agent's word, every ExchangeLoad)."""
        with self._lock:
            self._state, self._neighbours = state, heard

    def _neighbour_for(self, model: str) -> neighbours.Level | None:
        """Where a request of an overloaded node goes; None when the node is not overloaded for the model or no
        neighbour can take it. Called under the lock."""
        if model not in self._shed and self._state != neighbours.OVERLOADED:
            return None
        return neighbours.choose(self._neighbours, model, self.node, time.monotonic())

    def neighbour_for(self, model: str) -> neighbours.Level | None:
        """Where a request of this overloaded node for `model` goes (a model server's: the proxies pass it on), as
        a shed built-in model's goes (`_pass_on`); None when the node serves it itself. Safe from any thread."""
        with self._lock:
            return self._neighbour_for(model)

    def passed_on(self, model: str, node: str) -> None:
        """A model server's request that the neighbour `node` took (`neighbour_for`): counted as a passed-on built-in
        request is, shed in this node's load (it does not serve it) and in `volga_gateway_neighbour_forwards`."""
        with self._lock:
            self._arrived(model, queued=False).shed += 1
        self.metrics.neighbour_forwards.labels(model, node).inc()

    def drain_load(self) -> dict[str, ModelLoad]:
        """Each known model's load since the previous call (and its queue now); the counts start again."""
        with self._lock:
            loads, self._loads = self._loads, {}
            outstanding = dict(self._outstanding)
        models = {s.model_id for s in self.catalog.all()} | {e.model_id for e in self.catalog.ensembles()} | set(loads)
        empty = _Load()
        return {m: ModelLoad(got.arrivals, got.completed, outstanding.get(m, 0), tuple(got.latencies_ms), got.shed)
                for m in models for got in (loads.get(m, empty),)}

    def _arrived(self, model: str, queued: bool = True) -> _Load:
        """A request of the model (or an ensemble's step of it) starts; with `queued`, it is in the model's queue
        until `_answered`. Called under the lock."""
        counts = self._load(model)
        counts.arrivals += 1
        if queued:
            self._outstanding[model] = self._outstanding.get(model, 0) + 1
        return counts

    def _answered(self, model: str, elapsed_ms: float, queued: bool = True) -> None:
        """A request `_arrived` got its answer (any status). Called under the lock."""
        if queued:
            self._outstanding[model] -= 1
        counts = self._load(model)
        counts.completed += 1
        counts.latencies_ms.append(elapsed_ms)

    def _load(self, model: str) -> _Load:
        """The model's counts since the last drain (made on first use, not on every request: each holds a deque).
        Called under the lock."""
        counts = self._loads.get(model)
        if counts is None:
            counts = self._loads[model] = _Load()
        return counts

    @contextlib.contextmanager
    def served(self, model: str, sheddable: bool = False) -> Iterator[None]:
        """One request of the model served past `observe`, counted in the model's load as `observe` counts one
        (an arrival, in the model's queue while it runs, a completion and its latency when it ends, whatever its
        outcome): an ensemble's steps (they go to `_dispatch` directly) and a model server's requests (the proxies
        pass them through, `proxy.Counted`). A `sheddable` request of a shed model (a server's: an ensemble's steps
        were refused as a whole, before the first) is refused at once, as `observe` refuses one: `batcher.Overloaded`
        with the model's retry hint, counted as an arrival shed (not in the queue, no completion: this node does
        not serve it) and in `volga_gateway_shed_requests`. Safe from any thread."""
        with self._lock:
            retry_after_ms = self._shed.get(model) if sheddable else None
            counts = self._arrived(model, queued=retry_after_ms is None)
            if retry_after_ms is not None:
                counts.shed += 1
        if retry_after_ms is not None:
            self.metrics.shed.labels(model).inc()
            raise batcher.Overloaded(f"model {model!r} is shedding load; retry after {retry_after_ms} ms",
                                     retry_after_ms)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed_ms = (time.perf_counter() - start) * 1e3
            with self._lock:
                self._answered(model, elapsed_ms)

    def _require(self, model: str) -> None:
        if not self.catalog.known(model):
            raise errors.UnknownModel(f"unknown model {model!r}: no ModelSpec has this modelId")

    # -- metadata ------------------------------------------------------------------------------------

    def require_version(self, model: str, version: str) -> None:
        """A request for a version the model does not serve is NOT_FOUND, as Triton and KServe answer it; no version
        ("") asks for the one it serves."""
        if not version:
            return
        found = self.catalog.find_ensemble(model)
        served = found.version if found is not None else self.catalog.get(model).version
        if version != served:
            raise oip.error("NOT_FOUND", f"model {model!r} has no version {version!r}: it serves version {served!r}")

    async def model_ready(self, model: str, version: str = "") -> bool:
        if (found := self.catalog.find_ensemble(model)) is not None:
            return version in ("", found.version) and (await self.ensemble_state(found)).ready
        if not self.catalog.known(model) or version not in ("", self.catalog.get(model).version):
            return False
        return (await self.model_state(self.catalog.get(model))).ready

    async def ensemble_state(self, found: ensemble.Ensemble) -> ModelState:
        """READY when every model of the ensemble is; else the first that is not, and why."""
        states = await asyncio.gather(*(self.model_state(self.catalog.get(m)) for m in found.members))
        down = next((s for s in states if not s.ready), None)
        if down is not None:
            return ModelState(found.model_id, found.version, "UNAVAILABLE", f"model {down.name!r}: {down.reason}")
        return ModelState(found.model_id, found.version, "READY",
                          "; ".join(f"{s.name}: {s.reason}" for s in states))

    async def model_state(self, spec: api.ModelSpecSpec) -> ModelState:
        """READY when some instance of the model can serve, as far as the catalog (cluster placements) and the
        agent (its instances: tier, and why the last start or wake failed) know; the reason says the tiers."""
        model = spec.model_id

        def unavailable(reason: str) -> ModelState:
            return ModelState(model, spec.version, "UNAVAILABLE", reason)

        if not self.catalog.ready(model, self.node):
            here = self.catalog.local(model, self.node) or ()
            return unavailable(f"{_tiers(p.tier for p in here)}: not Ready yet" if here
                               else f"no instance on node {self.node}")
        try:
            states = await self.router.link.instances(model)
        except ConnectionError as exc:
            return unavailable(f"cannot reach the agent: {exc}")
        if states is None:  # the link cannot tell: the catalog's word, with the tiers its placements say
            placed = self.catalog.local(model, self.node)
            return ModelState(model, spec.version, "READY", _tiers(p.tier for p in placed) if placed else "")
        if not states:
            return unavailable("the agent has no instance of the model")
        tiers = _tiers(s.tier for s in states)
        if all(s.down for s in states):
            why = "; ".join(dict.fromkeys(f"{s.name}: {s.reason}" for s in states))
            return unavailable(f"{tiers}; {why}")
        return ModelState(model, spec.version, "READY", tiers)

    async def answered_outputs(self, spec: api.ModelSpecSpec) -> list[api.TensorSpec]:
        """The model's outputs as its answers have them: where a worker's warm-up saw answers that contradict the
        declared shapes (the agent's instances say), the answered shapes; the catalog keeps them for when the agent
        cannot be asked."""
        try:
            states = await self.router.link.instances(spec.model_id)
        except ConnectionError:
            states = None
        answered = next((s.answered_outputs for s in states or () if s.answered_outputs), None)
        if answered is not None:
            self.catalog.answered(spec.model_id, answered)
        return self.catalog.outputs(spec.model_id)

    async def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        self.require_version(model, version)
        if (found := self.catalog.find_ensemble(model)) is not None:
            return ModelMetadata(found.model_id, (found.version,), ensemble.PLATFORM, _tensor_specs(found.inputs),
                                 _tensor_specs(found.outputs))
        spec = self.catalog.get(model)
        return ModelMetadata(spec.model_id, (spec.version,), PLATFORMS[spec.framework.value],
                             _tensor_specs(spec.inputs), _tensor_specs(await self.answered_outputs(spec)))

    async def model_config(self, model: str, version: str = "") -> ModelConfig:
        """Triton's convention: with max_batch_size > 0 the batch dimension (the first, -1 in the ModelSpec)
        is implicit; a model whose tensors do not all start with -1 is not batched (max_batch_size 0)."""
        self.require_version(model, version)
        if (found := self.catalog.find_ensemble(model)) is not None:
            skip = 1 if found.max_batch_size else 0
            return ModelConfig(found.model_id, ensemble.PLATFORM, "", found.max_batch_size,
                               _tensor_specs(found.inputs, skip), _tensor_specs(found.outputs, skip),
                               ensemble_steps=found.steps)
        spec = self.catalog.get(model)
        outputs = await self.answered_outputs(spec)
        tensors = [*spec.inputs, *outputs]
        batched = all(t.shape and t.shape[0] == -1 for t in tensors)
        skip = 1 if batched else 0
        b = spec.runtime.dynamic_batching
        dynamic = DynamicBatchingConfig(tuple(b.preferred_batch_sizes), b.max_queue_delay_microseconds,
                                        b.max_queue_size) if b.enabled and batched else None
        return ModelConfig(spec.model_id, PLATFORMS[spec.framework.value], BACKENDS[spec.framework.value],
                           spec.runtime.max_batch_size if batched else 0, _tensor_specs(spec.inputs, skip),
                           _tensor_specs(outputs, skip), dynamic)

    async def repository_index(self) -> list[ModelState]:
        states = await asyncio.gather(*(self.model_state(s) for s in self.catalog.all()),
                                      *(self.ensemble_state(e) for e in self.catalog.ensembles()))
        refused = [ModelState(r.model_id, r.version, "UNAVAILABLE", r.reason) for r in self.catalog.refusals()]
        return sorted([*states, *refused], key=lambda s: s.name)

    # -- inference -----------------------------------------------------------------------------------

    async def infer(self, model: str, request_headers: Mapping[str, str], inputs: dict[str, np.ndarray],
                    grpc_remaining: float | None = None, version: str = ""
                    ) -> tuple[api.ModelSpecSpec | ensemble.Ensemble, dict[str, np.ndarray]]:
        self.require_version(model, version)
        found = self.catalog.find_ensemble(model)
        spec = self.catalog.get(found.head if found is not None else model)
        claimed = request_headers.get("x-input-hash")
        if claimed and claimed.lower() != (schema := self.catalog.input_hash(spec.model_id)):
            raise oip.error("INVALID_ARGUMENT", f"x-input-hash {claimed[:16]}... does not match model {model!r} "
                            f"(its input schema hash is {schema}); the client was built for "
                            "another version of the model")
        self.catalog.check_inputs(spec.model_id, inputs)
        deadline = _deadline(request_headers.get("x-timeout-ms"), grpc_remaining)
        if found is not None:
            # The input hash is the ensemble's: a step forwarded to another node must not carry it.
            step_headers = {k: v for k, v in request_headers.items() if k != "x-input-hash"}

            async def step(member: str, step_inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                with self.served(member):
                    return (await self._dispatch(self.catalog.get(member), step_headers, step_inputs, deadline))[1]

            return found, await ensemble.run(found, inputs, step)
        return await self._dispatch(spec, request_headers, inputs, deadline)

    async def _dispatch(self, spec: api.ModelSpecSpec, request_headers: Mapping[str, str],
                        inputs: dict[str, np.ndarray], deadline: float | None
                        ) -> tuple[api.ModelSpecSpec, dict[str, np.ndarray]]:
        """One checked request for one model: to another node's gateway, through its batcher, or to a worker."""
        model = spec.model_id
        diverted = _diverted.get()
        if diverted is not None and diverted.model == model:
            outputs = await self._pass_on(model, diverted.retry_after_ms, request_headers, inputs, deadline)
            if outputs is not None:
                return spec, outputs
        here = self.catalog.local(model, self.node)
        if here is not None and not here:
            return spec, await self._forward(model, request_headers, inputs, deadline)
        hint = request_headers.get("x-device-hint", "")
        if spec.runtime.dynamic_batching.enabled and spec.batches:
            return spec, await self._batcher(spec).submit(inputs, hint, deadline)
        return spec, await self._run(model, inputs, hint, deadline)

    def _batcher(self, spec: api.ModelSpecSpec) -> batcher.Batcher:
        model, policy = spec.model_id, batcher.Policy.of(spec)
        with self._lock:
            found = self.batchers.get(model)
            if found is None:
                async def run(inputs: dict[str, np.ndarray], hint: str, deadline: float | None
                              ) -> dict[str, np.ndarray]:
                    return await self._run(model, inputs, hint, deadline)

                found = self.batchers[model] = batcher.Batcher(model, policy, run, self.metrics,
                                                                self._caps.get(model))
        if found.policy != policy:
            found.set_policy(policy)
        return found

    async def _run(self, model: str, inputs: dict[str, np.ndarray], hint: str, deadline: float | None
                   ) -> dict[str, np.ndarray]:
        """One worker call (a request, or a batch of them): wake, send, and resend what comes back unrun."""
        for attempt in range(1, UNRUN_ATTEMPTS + 1):
            route = await _within(deadline, self.router.route(model, hint, _ms_left(deadline)), "waking an instance")
            socket = self.workers.least_busy((route.socket, *route.also)) if route.also else route.socket
            try:
                return await self._infer(model, socket, inputs, deadline)
            except (workers.WorkerGone, workers.WorkerDied) as exc:
                self.router.invalidate(model)
                self.workers.forget(socket)
                if isinstance(exc, workers.WorkerDied):
                    # It died while holding this request (which may be what killed it): fail this one only;
                    # the next request's activation finds the worker dead and restarts it.
                    raise oip.error("UNAVAILABLE", f"model {model!r}: {exc}; the instance is being "
                                    "restarted, retry") from None
                # Demoted or gone before it ran this request: wake again and resend. A model demoted again
                # while the resend waits (freezes in quick succession) hands it back again: bounded retries.
                if attempt == UNRUN_ATTEMPTS:
                    raise oip.error("UNAVAILABLE", f"model {model!r}: {exc}; retry later") from None
            except protocol.WorkerError as exc:
                raise oip.error(exc.code, exc.message) from None
        raise AssertionError("unreachable")

    async def _infer(self, model: str, socket: str, inputs: dict[str, np.ndarray], deadline: float | None
                     ) -> dict[str, np.ndarray]:
        """One worker call; while the guard protects the model, marked in flight for as long as it lasts."""
        guard = self.guard
        if guard is not None and not guard.protects(model):
            guard = None
        if guard is not None:
            guard.enter()
        try:
            return await _within(deadline, self.workers.infer(socket, inputs), "inference")
        finally:
            if guard is not None:
                guard.leave()

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

    async def _pass_on(self, model: str, retry_after_ms: int | None, request_headers: Mapping[str, str],
                       inputs: dict[str, np.ndarray], deadline: float | None) -> dict[str, np.ndarray] | None:
        """An overloaded node's request: to the least-loaded neighbour that can take it, unless it was forwarded
        here already. When none takes it: refused (a shed model), or None to serve it here (a node in EMERGENCY
        that does not shed the model)."""
        with self._lock:
            target = None if request_headers.get(links.FORWARDED) else self._neighbour_for(model)
        if target is not None:
            timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                outputs = await _within(deadline, self.forwarder.infer(target.gateway, model, inputs, request_headers,
                                                                       self.node, timeout), "forwarding to a neighbour")
            except oip.OipError as exc:
                if exc.code == "DEADLINE_EXCEEDED":
                    raise
                log.info("model %r: neighbour %s did not take the request: %s", model, target.node, exc.message)
            else:
                self.metrics.neighbour_forwards.labels(model, target.node).inc()
                return outputs
        if retry_after_ms is None:
            return None
        self.metrics.shed.labels(model).inc()
        raise batcher.Overloaded(f"model {model!r} is shedding load; retry after {retry_after_ms} ms", retry_after_ms)

    async def observe(self, model: str, proto: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run one request of an adapter: the links' errors become OipErrors, and the outcome is counted. A request
        for a shed model is refused here, before its body is decoded, unless a neighbour can take it; a request of
        an overloaded node that a neighbour can take goes on to `_dispatch`, which passes it on. Either counts as
        shed in the node's load: this node does not serve it.

        An ensemble counts under its own id (arrivals, completions, latencies, shed; its queue is in its models',
        a step at a time). One that needs a shed model is refused here as a whole, with the longest retry hint of
        its shed models, and counts as shed in its own load and in each of its models' (none of them serves it);
        it is not passed on to a neighbour."""
        start = time.perf_counter()
        code = "OK"
        known = self.catalog.known(model)
        found = None if known else self.catalog.find_ensemble(model)
        refused = None if known or found is not None else self.catalog.refusal(model)
        diverted = False
        refusal = ""
        with self._lock:
            retry_after_ms = self._shed.get(model) if known else None
            if known:
                diverted = self._neighbour_for(model) is not None
                counts = self._arrived(model, queued=retry_after_ms is None and not diverted)
                if retry_after_ms is not None or diverted:
                    counts.shed += 1
            elif found is not None:
                counts = self._arrived(model, queued=False)
                shed = [(self._shed[m], m) for m in found.members if m in self._shed]
                if shed:
                    retry_after_ms, member = max(shed)
                    refusal = f"ensemble {model!r}: its model {member!r} is shedding load; "
                    counts.shed += 1
                    for m in found.members:
                        self._arrived(m, queued=False).shed += 1
        token = _diverted.set(_Diverted(model, retry_after_ms) if diverted else None)
        try:
            if refused is not None:  # before its body is decoded: nothing it carries can change the answer
                raise oip.error("UNAVAILABLE", refused.message)
            if retry_after_ms is not None and not diverted:
                self.metrics.shed.labels(model).inc()
                reason = refusal or f"model {model!r} is shedding load; "
                raise batcher.Overloaded(f"{reason}retry after {retry_after_ms} ms", retry_after_ms)
            return await call()
        except oip.OipError as exc:
            code = exc.code
            if code == "CANCELLED":
                log.info("%s request for %r: %s", proto, model, exc.message)
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"  # the client went away (gRPC cancels the handler)
            log.info("%s request for %r: cancelled by the client", proto, model)
            raise
        except errors.UnknownModel as exc:
            code = "NOT_FOUND"
            raise oip.error(code, str(exc)) from None
        except errors.ActivationFailed as exc:
            code = "UNAVAILABLE"
            raise oip.error(code, f"could not wake model {model!r}: {exc}") from None
        except Exception as exc:
            code = "INTERNAL"
            log.exception("%s request for %r failed unexpectedly", proto, model)
            raise oip.error(code, f"internal error: {type(exc).__name__}: {str(exc)[:200]}") from None
        finally:
            _diverted.reset(token)
            # Names clients make up must not become label values: one series per known model only.
            label = model if known or found is not None or refused is not None else UNKNOWN_MODEL_LABEL
            elapsed_ms = (time.perf_counter() - start) * 1e3
            counted = self._counted.get((label, proto, code))
            if counted is None:
                counted = self._counted[label, proto, code] = self.metrics.requests.labels(label, proto, code)
            counted.inc()
            if code == "OK":
                timed = self._timed.get((label, proto))
                if timed is None:
                    timed = self._timed[label, proto] = self.metrics.latency.labels(label, proto)
                timed.observe(elapsed_ms)
            if (known or found is not None) and retry_after_ms is None and not diverted:
                with self._lock:
                    self._answered(model, elapsed_ms, queued=known)

    async def close(self) -> None:
        for b in list(self.batchers.values()):
            await b.close()
        self.workers.close()
        await self.forwarder.close()
        await self.router.link.close()


def config_grpc(c: ModelConfig) -> Any:
    """The gRPC ModelConfig response of a model's configuration."""
    response = oip.model_config_grpc(c.name, c.platform, c.backend, c.max_batch_size, c.inputs, c.outputs)
    if c.dynamic_batching is not None:
        d = response.config.dynamic_batching
        d.preferred_batch_size.extend(c.dynamic_batching.preferred_batch_size)
        d.max_queue_delay_microseconds = c.dynamic_batching.max_queue_delay_microseconds
        d.default_queue_policy.max_queue_size = c.dynamic_batching.max_queue_size
    for step in c.ensemble_steps:
        response.config.ensemble_scheduling.step.add(model_name=step.model_id, model_version=-1,
                                                     input_map=step.input_map, output_map=step.output_map)
    return response


def config_rest(c: ModelConfig) -> dict[str, Any]:
    """The REST (`GET /v2/models/{name}/config`) form of `config_grpc`, as Triton writes it."""
    body = oip.model_config_rest(c.name, c.platform, c.backend, c.max_batch_size, c.inputs, c.outputs)
    if c.dynamic_batching is not None:
        d = c.dynamic_batching
        body["dynamic_batching"] = {
            "preferred_batch_size": list(d.preferred_batch_size),
            "max_queue_delay_microseconds": d.max_queue_delay_microseconds, "preserve_ordering": False,
            "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 0,
                                     "allow_timeout_override": False, "max_queue_size": d.max_queue_size}}
    if c.ensemble_steps:
        body["ensemble_scheduling"] = {"step": [
            {"model_name": step.model_id, "model_version": -1, "input_map": step.input_map,
             "output_map": step.output_map} for step in c.ensemble_steps]}
    return body


async def off_loop(size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` (a decode or an encode of `size` bytes): in a thread when large, inline when not."""
    if size < OFF_LOOP_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _tiers(tiers: Iterable[str]) -> str:
    """'FROZEN (1 instance)', 'HOT (1 instance), COLD (2 instances)': fastest to wake first."""
    counts = collections.Counter(tiers)
    order = [t.value for t in api.Tier]
    return ", ".join(f"{t} ({n} instance{'s' if n > 1 else ''})"
                     for t, n in sorted(counts.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9))


# Far beyond any wake or inference; a larger x-timeout-ms is refused rather than overflowing the arithmetic.
MAX_TIMEOUT_MS = 86_400_000


def _deadline(timeout_ms: str | None, grpc_remaining: float | None) -> float | None:
    budget = grpc_remaining
    if timeout_ms:
        try:
            value = float(timeout_ms)
        except ValueError:
            raise oip.error("INVALID_ARGUMENT", f"x-timeout-ms {timeout_ms[:40]!r} is not a number") from None
        if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_MS:
            raise oip.error("INVALID_ARGUMENT", f"x-timeout-ms must be a number of milliseconds above 0 and at "
                            f"most {MAX_TIMEOUT_MS} (a day), got {timeout_ms[:40]!r}")
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
